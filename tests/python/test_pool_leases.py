"""Pool mode with several threads (Note [one MemPool per thread and device at a time] in
_install.py): PyTorch refuses a MemPool that is already recording on the device, by any
thread (the H200 run of 2026-12-04 stopped two models stepped in two threads with
"beginAllocateToPool: already recording to mempool_id"; fake_torch_cuda.py's
use_mem_pool refuses as PyTorch does). Each thread in a tidepool scope on a device gets a
pool no other thread is using there, a scope inside another of the same tag on the same
thread keeps the pool it has (one of another tag routes to its tag's pool and the outer
one's routes again after it), and a failure while a scope opens leaves no pool taken and
no step counted in flight, so no other thread waits for it. A step moves state by
pointer only while it is alone on the device (Note [steps in flight in pool mode] in
_in_flight.py). Threads are paced by events: the same interleaving on every run."""

from __future__ import annotations

import threading

import pytest
import torch

import tidepool
from tidepool import _in_flight, _install, _state_tensors, _tiering

from fake_tiering import EVICT, fake_tiering, prefetch_of  # noqa: F401  (a fixture)
from fake_torch_cuda import fake_cuda, install  # noqa: F401  (a fixture, and the install)
from test_optim_hooks_threads import PacedSGD, model, run_threads, waited

WAIT = 10  # seconds: only a broken test waits that long


def pools_made(fake_cuda) -> int:
    return sum(1 for c in fake_cuda if c[0] == "mempool")


def pool_events(fake_cuda) -> list:
    return [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")]


def pools_entered(monkeypatch) -> list:
    """The MemPools torch.cuda.use_mem_pool is entered with from now on, in order."""
    entered = []
    fake_use_mem_pool = torch.cuda.use_mem_pool

    def recording(pool, device=None):
        entered.append(pool)
        return fake_use_mem_pool(pool, device)

    monkeypatch.setattr(torch.cuda, "use_mem_pool", recording)
    return entered


def sgd_with_a_gradient() -> torch.optim.SGD:
    """An SGD with momentum over one parameter with a gradient: its step makes state."""
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    return torch.optim.SGD([p], lr=0.1, momentum=0.9)


def test_steps_of_two_threads_at_once_route_to_pools_of_their_own(fake_cuda, fake_tiering):
    # As the device check's two_threads: b's step is under way when a's begins and ends.
    install(mode="pool", state_budget="1GiB")
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    a = PacedSGD([model(2)], lr=0.1, momentum=0.9)
    b = PacedSGD([model(3)], lr=0.1, momentum=0.9)
    a.step()  # one at a time: both have state now, in the first pool
    b.step()
    assert pools_made(fake_cuda) == 1
    fake_cuda.clear()
    fake_tiering.clear()

    def b_inside():
        b_in.set()
        waited(a_out)

    def step_a():
        try:
            waited(b_in)
            a.step()
        finally:
            a_out.set()

    # Parameters added now make both steps state steps, which enter the pools (Note [only
    # state steps enter the pool] in _step_scopes.py); the state made before is prefetched.
    a.add_param_group({"params": [model(4)]})
    b.add_param_group({"params": [model(5)]})
    b_prefetch = prefetch_of(b)  # the state b has when its step begins
    b.inside = b_inside
    run_threads(b.step, step_a)
    assert pools_made(fake_cuda) == 1  # made now: a second pool, for a's step
    assert pool_events(fake_cuda) == [("enter_pool", 0), ("enter_pool", 0), ("exit_pool", 0),
                                      ("exit_pool", 0)]
    # Note [steps in flight in pool mode]: b, alone when it began, prefetched; a, which
    # overlapped b, moved nothing (its state may share b's segments); b, the last, evicted
    # the tag.
    assert fake_tiering == [b_prefetch, EVICT]
    assert _install.STATE.pool_leases == {}
    # One at a time, a state step takes the first pool again: no third is made.
    a.add_param_group({"params": [model(6)]})
    b.add_param_group({"params": [model(7)]})
    a_prefetch, b_prefetch = prefetch_of(a), prefetch_of(b)
    b.inside = lambda: None
    run_threads(a.step)
    run_threads(b.step)
    assert pools_made(fake_cuda) == 1
    assert pool_events(fake_cuda)[4:] == [("enter_pool", 0), ("exit_pool", 0)] * 2
    assert fake_tiering[2:] == [a_prefetch, EVICT, b_prefetch, EVICT]


def test_a_step_that_begins_while_a_step_alone_prefetches_waits_for_it(
        fake_cuda, fake_tiering, monkeypatch):
    # In pool mode the prefetch of a step alone on the device may move segments that hold
    # another optimizer's state too: no step may begin (and run its kernels on that
    # state) until it is done.
    install(mode="pool", state_budget="1GiB")
    a = PacedSGD([model(2)], lr=0.1, momentum=0.9)
    b = PacedSGD([model(3)], lr=0.1, momentum=0.9)
    a.step()
    b.step()
    fake_tiering.clear()
    prefetching, release, b_in = threading.Event(), threading.Event(), threading.Event()
    record_prefetch = _tiering.prefetch_ptrs

    def slow_prefetch(d, ptrs, stream):  # a's; b's comes after
        if not prefetching.is_set():
            prefetching.set()
            waited(release)
        return record_prefetch(d, ptrs, stream)

    monkeypatch.setattr(_tiering, "prefetch_ptrs", slow_prefetch)
    a_out = threading.Event()

    def b_inside():
        b_in.set()
        waited(a_out)  # a ends first

    def step_a():
        try:
            a.inside = lambda: waited(b_in)  # b begins while a is in flight
            a.step()
        finally:
            a_out.set()

    def step_b():
        waited(prefetching)
        b.inside = b_inside
        b.step()

    def release_when_b_waits():
        waited(prefetching)
        # Not a timing bound: a step that gets in while a's prefetch runs is the failure.
        assert not b_in.wait(0.3), "b's step began while a's prefetch ran"
        release.set()

    run_threads(step_a, step_b, release_when_b_waits)
    # b overlapped a: no prefetch; a ended while b was in flight: no eviction; b, the last
    # one, evicted the tag.
    assert fake_tiering == [prefetch_of(a), EVICT]


def test_regions_of_two_threads_at_once(fake_cuda):
    install(mode="pool")
    both_inside = threading.Barrier(2, timeout=WAIT)
    tags = []

    def body(name):
        with tidepool.region(name) as tag:
            tags.append(tag)
            both_inside.wait()

    run_threads(lambda: body("kv_cache"), lambda: body("activations"))
    assert pools_made(fake_cuda) == 2 and len(set(tags)) == 2
    assert _install.STATE.pool_leases == {}


def test_a_region_inside_a_step_routes_to_its_own_pool_and_the_step_s_resumes(
        fake_cuda, fake_tiering):
    # Note [a MemPool per tag]: the step's pool is left while the region lasts (entering a
    # pool the thread records to already would be refused by PyTorch; keeping it would put
    # the region's tensors in the state's pool), and entered again after.
    install(mode="pool")
    seen = []

    def inside():
        with tidepool.region("scratch", device=0) as tag:
            seen.append(tag)
            with tidepool.region("scratch"):  # the current device: the same one, kept
                pass

    a = PacedSGD([model(2)], inside, lr=0.1, momentum=0.9)
    a.step()
    assert seen and pools_made(fake_cuda) == 2
    assert pool_events(fake_cuda) == [("enter_pool", 0), ("exit_pool", 0), ("enter_pool", 0),
                                      ("exit_pool", 0), ("enter_pool", 0), ("exit_pool", 0)]
    assert _install.STATE.pool_leases == {}


def test_a_step_inside_a_region_puts_its_state_in_the_state_pool(fake_cuda, fake_tiering,
                                                                   monkeypatch):
    # Review finding: with the training loop inside tidepool.region("train"), the step's
    # lease only counted, so its state was made in the region's pool (never evicted) and
    # the region's later tensors could land in state segments.
    install(mode="pool", state_budget="1GiB")
    entered = pools_entered(monkeypatch)
    optimizer = sgd_with_a_gradient()
    with tidepool.region("train") as train:
        optimizer.step()  # makes state
        # The region's pool routes again after the step.
        assert _install.STATE.pool_leases[0][threading.get_ident()][-1].tag == train
    region_pool, state_pool = _install.pool(0, train), _install.pool(0)
    assert region_pool is not state_pool
    assert entered == [region_pool, state_pool, region_pool]
    assert _install.STATE.pool_leases == {}


def test_a_scope_of_another_tag_that_cannot_enter_its_pool_leaves_the_outer_one_routing(
        fake_cuda, monkeypatch):
    install(mode="pool")
    real_use = torch.cuda.use_mem_pool
    failures = []

    def use_mem_pool(pool, device=None):
        if failures:
            raise failures.pop()
        return real_use(pool, device)

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    with tidepool.region("outer") as outer:
        failures.append(RuntimeError("entering the inner pool failed"))
        with pytest.raises(RuntimeError, match="inner pool"):
            with tidepool.region("inner"):
                pass
        stack = _install.STATE.pool_leases[0][threading.get_ident()]
        assert [lease.tag for lease in stack] == [outer]
        assert stack[-1].context is not None  # entered again
    assert _install.STATE.pool_leases == {}
    assert pool_events(fake_cuda)[-2:] == [("enter_pool", 0), ("exit_pool", 0)]


def test_a_failure_while_a_step_opens_its_scope_leaves_nothing_taken(
        fake_cuda, fake_tiering, monkeypatch):
    # An optimizer on devices 0 and 1 whose pool cannot be entered on device 1 (once):
    # the step raises, device 0's pool is left again, nothing is counted in flight, and
    # another thread's step goes on at once.
    install(mode="pool")
    monkeypatch.setattr(_state_tensors, "_cuda_devices", lambda optimizer: [0, 1])
    real_use = torch.cuda.use_mem_pool
    failures = [RuntimeError("CUDA error: out of memory (entering the pool)")]

    def use_mem_pool(pool, device=None):
        if device == 1 and failures:
            raise failures.pop()
        return real_use(pool, device)

    monkeypatch.setattr(torch.cuda, "use_mem_pool", use_mem_pool)
    a = PacedSGD([model(2)], lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="entering the pool"):
        a.step()
    assert pool_events(fake_cuda) == [("enter_pool", 0), ("exit_pool", 0)]
    assert _install.STATE.pool_leases == {} and _in_flight.in_flight() == {}
    b = PacedSGD([model(3)], lr=0.1, momentum=0.9)
    run_threads(b.step)  # would find device 0 counted in flight, or its pool taken
    assert fake_tiering[-2:] == [("evict", 0, EVICT[2], EVICT[3]), ("evict", 1, EVICT[2], EVICT[3])]
    a.step()  # and the failed step's optimizer steps again
    assert _install.STATE.pool_leases == {}


def test_optimizer_state_and_a_region_get_pools_of_their_own(fake_cuda, fake_tiering,
                                                              monkeypatch):
    # Review finding (Note [a MemPool per tag] in _install.py): a region and the state
    # steps shared one MemPool, whose freed blocks PyTorch hands to the pool's next
    # allocations whatever their tag: state could land in a region's freed blocks (never
    # evicted) and a region's tensors in freed state blocks (moved to the host each step).
    install(mode="pool", state_budget="1GiB")
    entered = pools_entered(monkeypatch)
    with tidepool.region("kv_cache") as kv:
        pass
    optimizer = sgd_with_a_gradient()
    optimizer.step()  # makes state: enters a pool
    with tidepool.region("kv_cache"):
        pass
    with tidepool.region("optimizer_state"):  # the state's own pool, by name
        pass
    assert len(entered) == 4
    region_pool, state_pool = entered[0], entered[1]
    assert region_pool is not state_pool
    assert entered[2] is region_pool and entered[3] is state_pool
    assert _install.pool(0) is state_pool
    assert _install.pool(0, kv) is region_pool
    assert pools_made(fake_cuda) == 2


def test_a_region_of_an_id_that_names_no_tag_makes_no_pool(fake_cuda):
    # Review finding: the id went on to the lease, which made a MemPool for it (kept for
    # the process's life) before the tag push refused the id.
    install(mode="pool")
    with pytest.raises(ValueError, match="no tag has the id 40"):
        with tidepool.region(40):
            pass
    assert pools_made(fake_cuda) == 0 and _install.STATE.pools == {}
    assert _install.STATE.pool_leases == {}



def test_scopes_closed_out_of_order_end_their_own_leases(fake_cuda):
    # Review finding: a scope's exit took the innermost lease for its own, so a region
    # closed before one opened inside it (a generator holding it across a step) left the
    # inner scope's pool and entered its own again, for the inner scope's allocations.
    install(mode="pool")
    first, second = tidepool.region("first"), tidepool.region("second")
    first.__enter__()
    second_tag = second.__enter__()
    with pytest.warns(RuntimeWarning, match="closed out of order"):
        first.__exit__(None, None, None)
    stack = _install.STATE.pool_leases[0][threading.get_ident()]
    assert [lease.tag for lease in stack] == [second_tag]
    assert stack[0].context is not None  # the second region's pool still routes
    assert pool_events(fake_cuda)[-1] == ("enter_pool", 0)
    second.__exit__(None, None, None)
    assert _install.STATE.pool_leases == {}
    assert pool_events(fake_cuda)[-1] == ("exit_pool", 0)


def test_a_region_in_a_forked_child_tags_without_a_pool(fake_cuda, monkeypatch):
    # Review finding: in a child forked after CUDA was used, pool mode's region asked for
    # the current device and raised "Cannot re-initialize CUDA in forked subprocess"; the
    # child allocates nothing on the GPU, so the region only tags, as in global mode.
    install(mode="pool")
    from tidepool import _lib, _tags

    def no_cuda_here():
        raise RuntimeError("Cannot re-initialize CUDA in forked subprocess")

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", no_cuda_here)
    lib = _lib.load()
    before = len(pool_events(fake_cuda))
    with tidepool.region("activation") as tag:
        assert tag == _tags.tag_id("activation")
        assert lib.tidepool_tag_current() == tag
    assert lib.tidepool_tag_current() == 0
    assert len(pool_events(fake_cuda)) == before
