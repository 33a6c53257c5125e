"""Optimizer steps of two threads on one device at once (Note [steps in flight] in
_in_flight.py), with torch's CUDA entry points and the tiering C ABI replaced by
recorders (fake_torch_cuda.py, fake_tiering.py): a step that ends while the other
thread's is in flight evicts only its own state, by pointer (with the state of the
optimizers stepped inside it), the last one to end evicts the tag, and a step that
begins while that eviction runs waits for it. The threads are paced by events, so the
interleaving is the same on every run."""

from __future__ import annotations

import threading

import pytest
import torch

from tidepool import _in_flight, _tiering

from fake_tiering import EVICT, evict_ptrs_of, fake_tiering, prefetch_of  # noqa: F401  (a fixture)
from fake_torch_cuda import fake_cuda, install  # noqa: F401  (a fixture, and the install)

WAIT = 10  # seconds: only a broken test waits that long


class PacedSGD(torch.optim.SGD):
    """SGD whose step() calls self.inside() after its update (its state exists by then),
    with the hooks' scope still open around it."""

    def __init__(self, params, inside=None, **kwargs):
        super().__init__(params, **kwargs)
        self.inside = inside or (lambda: None)

    def step(self, closure=None):
        result = super().step(closure)
        self.inside()
        return result


class Lookahead(PacedSGD):
    """A wrapper whose step runs another optimizer's inside its own."""

    def __init__(self, params, inner, inside=None):
        super().__init__(params, inside, lr=0.1, momentum=0.9)
        self.inner = inner

    def step(self, closure=None):
        self.inner.step()
        return super().step(closure)


def waited(event: threading.Event) -> None:
    assert event.wait(WAIT), "the other thread never got there"


def run_threads(*bodies) -> None:
    """Runs each body in a thread of its own; re-raises what one raised."""
    errors = []

    def run(body):
        try:
            body()
        except BaseException as e:  # noqa: BLE001  (handed to the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(body,)) for body in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT)
        assert not t.is_alive(), "a thread hangs"
    if errors:
        raise errors[0]


def model(n: int) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.ones(n))
    p.grad = torch.ones(n)
    return p


@pytest.mark.parametrize("first_ends", ["returning", "raising"])
def test_a_step_that_ends_while_another_threads_runs_evicts_only_its_own_state(
        fake_cuda, fake_tiering, first_ends):
    # a and b step at once on device 0; a ends first (by returning, or by raising: Note
    # [a step that raises]), while b is still in its step.
    install()
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()

    def a_inside():
        a_in.set()
        waited(b_in)
        if first_ends == "raising":
            raise RuntimeError("boom")

    def b_inside():
        b_in.set()
        waited(a_out)

    a = PacedSGD([model(2)], a_inside, lr=0.1, momentum=0.9)
    b = PacedSGD([model(3)], b_inside, lr=0.1, momentum=0.9)

    def step_a():
        try:
            if first_ends == "raising":
                with pytest.raises(RuntimeError, match="boom"):
                    a.step()
            else:
                a.step()
        finally:
            a_out.set()

    run_threads(step_a, b.step)
    # The tag would have taken b's momentum buffers from under b's step.
    assert fake_tiering == [evict_ptrs_of(a), EVICT]
    # One after the other, each step is alone on the device: by tag.
    fake_tiering.clear()
    a.inside = b.inside = lambda: None
    run_threads(a.step)
    run_threads(b.step)
    assert fake_tiering == [EVICT, EVICT]


def test_a_nested_step_s_state_is_evicted_with_its_enclosing_step_s(fake_cuda, fake_tiering):
    # Lookahead steps its inner optimizer inside its own step, on the device it holds: the
    # inner step evicts nothing itself, so the outer step's eviction by pointer names the
    # inner optimizer's state too.
    install()
    outer_in, other_in, outer_out = threading.Event(), threading.Event(), threading.Event()

    def outer_inside():
        outer_in.set()
        waited(other_in)

    def other_inside():
        other_in.set()
        waited(outer_out)

    inner = torch.optim.SGD([model(4)], lr=0.1, momentum=0.9)
    outer = Lookahead([model(2)], inner, outer_inside)
    other = PacedSGD([model(3)], other_inside, lr=0.1, momentum=0.9)

    def step_outer():
        try:
            outer.step()
        finally:
            outer_out.set()

    run_threads(step_outer, other.step)
    assert fake_tiering == [evict_ptrs_of(outer, inner), EVICT]


def test_a_step_that_begins_while_the_tag_is_evicted_waits_for_the_eviction(
        fake_cuda, fake_tiering, monkeypatch):
    # b, the last step on device 0, evicts the tag; a step of a begun then would have its
    # state prefetched and then taken back by that eviction.
    install(state_budget="1GiB")
    a_param = model(2)
    a = PacedSGD([a_param], lr=0.1, momentum=0.9)
    a.step()  # a has state to prefetch now
    b = PacedSGD([model(3)], lr=0.1, momentum=0.9)
    fake_tiering.clear()
    evicting, release, a_in = threading.Event(), threading.Event(), threading.Event()
    record_evict = _tiering.evict_tag

    def first_evict_slow(d, tag, stream):  # b's; a's comes after
        if not evicting.is_set():
            fake_tiering.append("evicting")
            evicting.set()
            waited(release)
        record_evict(d, tag, stream)

    monkeypatch.setattr(_tiering, "evict_tag", first_evict_slow)

    def step_a():
        waited(evicting)
        a.inside = a_in.set
        a.step()

    def release_when_a_waits():
        waited(evicting)
        # Not a timing bound: a step that gets in while the tag is evicted is the failure.
        assert not a_in.wait(0.3), "a's step began while b evicted the tag"
        assert _in_flight.in_flight() == {}
        release.set()

    run_threads(b.step, step_a, release_when_a_waits)
    assert fake_tiering == ["evicting", EVICT, prefetch_of(a), EVICT]


def test_the_c_side_counts_a_step_in_flight_on_another_thread(fake_cuda, fake_tiering):
    """Note [Steps of other threads] (tiering/steps_in_flight.cpp): while a step is in
    flight on one thread, the library knows it, so an out-of-memory on another thread
    leaves that step's state where it is; once the step is over the count is back to 0."""
    install()
    inside, release = threading.Event(), threading.Event()
    seen = []

    def pace():
        inside.set()
        waited(release)

    opt = PacedSGD([model(4)], pace, lr=0.1, momentum=0.9)

    def watch():
        waited(inside)
        seen.append(_tiering._fn("tidepool_steps_in_flight")(0))
        release.set()

    run_threads(opt.step, watch)
    assert seen == [1]
    assert _tiering._fn("tidepool_steps_in_flight")(0) == 0


def test_a_step_whose_closure_runs_is_no_step_in_flight_for_the_c_side(fake_cuda, fake_tiering):
    """The closure's backward runs on PyTorch's autograd threads: counted in meanwhile, the
    step would keep the state from moving when that backward runs out of memory (review
    finding). So the C side counts it out around its closure, and in again after."""
    install()
    counts = {}
    in_flight = _tiering._fn("tidepool_steps_in_flight")

    def closure():
        counts["closure"] = in_flight(0)
        return torch.tensor(1.0)

    opt = PacedSGD([model(4)], lambda: counts.setdefault("after", in_flight(0)), lr=0.1,
                   momentum=0.9)
    opt.step()  # its state exists from here: the steps hold device 0
    counts.clear()
    opt.step(closure)
    assert counts == {"closure": 0, "after": 1}
    assert in_flight(0) == 0
