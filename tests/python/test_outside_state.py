"""State an optimizer keeps outside optimizer.state (Note [state outside optimizer.state]
in _state_outside.py), with the tiering C ABI a recorder (fake_tiering.py) whose
device_ranges_except answers what a test says is on the device: after a step the hooks
ask which ranges of optimizer_state beyond the optimizer's own state are on the device,
and the next step prefetches those after its own; those the budget left on the host are
tried again while the range learnt still holds them, and an address another range took
since is not prefetched; nothing is asked without a state budget, nor in pool mode; a
failure to ask warns once and the eviction still happens."""

from __future__ import annotations

import warnings

import pytest
import torch

from tidepool import _state_outside, _tags, _tiering

from fake_tiering import EVICT, fake_tiering, state_pointers  # noqa: F401  (a fixture)
from fake_torch_cuda import fake_cuda, install  # noqa: F401  (a fixture, and the install)

EXTRA = 0x7F0000200000  # the base of a range of state kept on the optimizer object
OTHER = 0x7F0000400000


class OnDevice:
    """What the fake tiering layer says is on the device, which range holds each address
    (its id: 0 none), and the calls that asked."""

    def __init__(self, monkeypatch):
        self.on_device: list[int] = []
        self.ids: dict[int, int] = {}
        self.asked: list[tuple] = []
        monkeypatch.setattr(_tiering, "device_ranges_except", self.device_ranges_except)
        monkeypatch.setattr(_tiering, "range_ids",
                            lambda d, ptrs: [self.ids.get(p, 0) for p in ptrs])

    def device_ranges_except(self, device, tag, ptrs):
        self.asked.append((device, tag, tuple(ptrs)))
        return list(self.on_device)


@pytest.fixture
def on_device(monkeypatch, fake_tiering):
    return OnDevice(monkeypatch)


def stepped(optimizer, p):
    p.grad = torch.ones(4)
    optimizer.step()


def test_state_outside_optimizer_state_is_prefetched_after_its_own(fake_cuda, fake_tiering,
                                                                   on_device):
    install(state_budget="1GiB")
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    on_device.on_device = [EXTRA]  # the first step made it, on the device
    on_device.ids = {EXTRA: 1}
    stepped(optimizer, p)
    # Asked once, before the eviction, naming the optimizer's own state.
    assert on_device.asked == [(0, _tags.OPTIMIZER_STATE, state_pointers(optimizer))]
    assert fake_tiering == [EVICT]
    stepped(optimizer, p)
    assert fake_tiering[1] == ("prefetch", 0, state_pointers(optimizer) + (EXTRA,), 4242)
    # Freed before the third step: its range gone, that step no longer asks for it, and
    # forgets it.
    on_device.on_device, on_device.ids = [], {}
    stepped(optimizer, p)
    assert fake_tiering[3] == ("prefetch", 0, state_pointers(optimizer), 4242)
    assert _state_outside._known_outside_state(optimizer) == {}


def test_pool_mode_learns_no_state_outside_optimizer_state(fake_cuda, fake_tiering, on_device):
    # In pool mode the ranges are segments of PyTorch's allocator: one the first step's
    # temporaries left is kept by the pool and may hold another optimizer's state by the
    # next step, which the prefetch would bring in with this one's.
    install(mode="pool", state_budget="1GiB")
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    on_device.on_device = [EXTRA]
    on_device.ids = {EXTRA: 1}
    stepped(optimizer, p)
    stepped(optimizer, p)
    assert on_device.asked == []
    assert fake_tiering == [EVICT, ("prefetch", 0, state_pointers(optimizer), 4242), EVICT]


def test_what_the_budget_left_on_the_host_is_tried_again_while_a_range_holds_it(
        fake_cuda, fake_tiering, on_device):
    install(state_budget="1GiB")
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    on_device.on_device, on_device.ids = [EXTRA, OTHER], {EXTRA: 1, OTHER: 2}
    stepped(optimizer, p)
    on_device.on_device = [OTHER]  # the budget had no room for EXTRA: still a range, on the host
    stepped(optimizer, p)
    stepped(optimizer, p)
    assert fake_tiering[3] == ("prefetch", 0, state_pointers(optimizer) + (OTHER, EXTRA), 4242)


def test_each_optimizer_prefetches_only_what_it_keeps_outside(fake_cuda, fake_tiering, on_device):
    install(state_budget="1GiB")
    p, q = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    first = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    second = torch.optim.SGD([q], lr=0.5, momentum=0.9)
    on_device.on_device, on_device.ids = [EXTRA], {EXTRA: 1}
    stepped(first, p)
    on_device.on_device, on_device.ids = [], {EXTRA: 1}
    stepped(second, q)
    stepped(second, q)
    stepped(first, p)
    prefetches = [m for m in fake_tiering if m[0] == "prefetch"]
    assert prefetches == [("prefetch", 0, state_pointers(second), 4242),
                          ("prefetch", 0, state_pointers(first) + (EXTRA,), 4242)]


def test_an_address_another_range_took_since_is_not_prefetched(fake_cuda, fake_tiering,
                                                              on_device):
    install(state_budget="1GiB")
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    on_device.on_device, on_device.ids = [EXTRA], {EXTRA: 1}
    stepped(optimizer, p)
    # Freed after the step; another optimizer's state took the address (range 2), evicted
    # after that one's step: not this optimizer's, so not prefetched, and forgotten.
    on_device.on_device, on_device.ids = [], {EXTRA: 2}
    stepped(optimizer, p)
    assert fake_tiering[1] == ("prefetch", 0, state_pointers(optimizer), 4242)
    assert _state_outside._known_outside_state(optimizer) == {}
    # Made again by this optimizer's step at the same address (range 3), on the device:
    # learnt anew, with the new range's id, and prefetched before the next step.
    on_device.on_device, on_device.ids = [EXTRA], {EXTRA: 3}
    stepped(optimizer, p)
    assert _state_outside._known_outside_state(optimizer) == {0: {EXTRA: 3}}
    on_device.on_device = []
    stepped(optimizer, p)
    assert fake_tiering[5] == ("prefetch", 0, state_pointers(optimizer) + (EXTRA,), 4242)


def test_without_a_state_budget_nothing_is_asked(fake_cuda, fake_tiering, on_device):
    install()
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    on_device.on_device = [EXTRA]
    for _ in range(2):
        stepped(optimizer, p)
    assert on_device.asked == []
    assert fake_tiering == [EVICT, EVICT]
    assert _state_outside._known_outside_state(optimizer) == {}


def test_a_failure_to_learn_warns_once_and_the_state_is_still_evicted(fake_cuda, fake_tiering,
                                                                      on_device, monkeypatch):
    install(state_budget="1GiB")
    monkeypatch.setattr(_state_outside, "_warned_learning_failed", False)

    def failing(device, tag, ptrs):
        raise RuntimeError("tidepool: injected")

    monkeypatch.setattr(_tiering, "device_ranges_except", failing)
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([p], lr=0.5, momentum=0.9)
    with pytest.warns(RuntimeWarning, match="could not learn .*injected"):
        stepped(optimizer, p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        stepped(optimizer, p)  # said once
    assert [m for m in fake_tiering if m[0] == "evict"] == [EVICT, EVICT]
