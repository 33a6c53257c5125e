"""tidepool.evict() and tidepool.prefetch() of an optimizer's state or of tensors, by
pointer, next to the tag form: against the recorder of the tiering C ABI
(fake_tiering.py, every tensor counts as on CUDA device 0), and through the real C ABI
on the host backend, where tensors over tidepool's memory move and others are skipped."""

from __future__ import annotations

import json

import pytest
import torch

import tidepool
from tidepool import _state_tensors, _tags

from conftest import host_backend_script
from fake_tiering import fake_tiering, state_pointers  # noqa: F401  (a fixture)
from fake_torch_cuda import fake_cuda  # noqa: F401  (a fixture: a fresh, uninstalled STATE)

real_cuda_index = _state_tensors._cuda_index


def stepped_adamw():
    a, frozen = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2, 3))
    optimizer = torch.optim.AdamW([{"params": [a]}, {"params": [frozen], "lr": 1e-2}])
    a.grad, frozen.grad = torch.ones(4), torch.ones(2, 3)
    optimizer.step()
    frozen.grad = None  # the user's call names the state of every parameter
    return optimizer


def test_an_optimizers_state_moves_by_its_tensors_pointers(fake_cuda, fake_tiering):
    optimizer = stepped_adamw()
    ptrs = state_pointers(optimizer)
    assert len(ptrs) == 6  # step, exp_avg, exp_avg_sq of each parameter
    tidepool.evict(optimizer)
    assert tidepool.prefetch(optimizer, stream=7) == 0
    tidepool.evict(optimizer, device="cuda:0")
    tidepool.evict(optimizer, device=1)  # none of its state is there
    # The tag form is as it was: the whole tag, on one device (None: the current one).
    tidepool.evict("optimizer_state")
    tidepool.prefetch(_tags.OPTIMIZER_STATE, device=0, stream=3)
    assert fake_tiering == [("evict_ptrs", 0, ptrs, None), ("prefetch", 0, ptrs, 7),
                            ("evict_ptrs", 0, ptrs, None),
                            ("evict", 0, _tags.OPTIMIZER_STATE, None),
                            ("prefetch_tag", 0, _tags.OPTIMIZER_STATE, 3)]


def test_tensors_move_by_their_storages_pointers(fake_cuda, fake_tiering):
    a, b = torch.ones(8), torch.zeros(2, 3)
    view = a[2:]  # the storage's pointer, not the view's
    tidepool.evict([view, b])
    tidepool.evict(t for t in (b,))
    tidepool.prefetch(a, device=0, stream=9)  # one tensor
    tidepool.evict([])
    weight = torch.nn.Parameter(torch.ones(3))  # a tensor subclass is its own storage's
    tidepool.evict(weight)
    storage_a, storage_b = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    assert storage_a != view.data_ptr()
    assert fake_tiering == [("evict_ptrs", 0, (storage_a, storage_b), None),
                            ("evict_ptrs", 0, (storage_b,), None),
                            ("prefetch", 0, (storage_a,), 9),
                            ("evict_ptrs", 0, (weight.untyped_storage().data_ptr(),), None)]


def test_what_cannot_be_moved_is_a_clear_error(fake_cuda, fake_tiering, monkeypatch):
    for what in (None, 2.5, object()):
        with pytest.raises(TypeError, match="take a tag .a name or an id., "
                           "a torch.optim.Optimizer, "
                           "a tensor or an iterable of tensors, not"):
            tidepool.evict(what)
    with pytest.raises(TypeError, match="the iterable holds a str"):
        tidepool.prefetch([torch.ones(2), "exp_avg"])
    with pytest.raises(TypeError, match="the iterable holds a str"):
        tidepool.evict({"exp_avg": torch.ones(2)})  # a dict iterates over its keys
    with pytest.raises(ValueError, match=r"a tensor on cuda:0 was given with device=1"):
        tidepool.evict([torch.ones(2)], device=1)
    monkeypatch.setattr(_state_tensors, "_cuda_index", lambda t: t.numel() % 2)
    with pytest.raises(ValueError, match=r"a stream serves one device, and the tensors are on "
                       r"cuda:0, cuda:1; pass device="):
        tidepool.evict([torch.ones(2), torch.ones(3)], stream=5)
    with pytest.raises(ValueError, match="a torch.sparse_coo tensor has no storage to move"):
        tidepool.evict(torch.eye(3).to_sparse())
    monkeypatch.setattr(_state_tensors, "_cuda_index", real_cuda_index)
    with pytest.raises(ValueError, match="a tensor on cpu is not in CUDA memory"):
        tidepool.evict([torch.ones(2)])
    # An optimizer's state on the CPU (its step counters) is not an error: it is left out.
    tidepool.evict(stepped_adamw())
    assert fake_tiering == []


def test_tensors_over_tidepools_ranges_move_and_others_are_skipped(run_python):
    # The real C ABI (host backend: "device" memory is host RAM, so a CPU tensor can be
    # made over a pointer-stable range); a tensor in no range is skipped, not an error.
    out = json.loads(run_python(host_backend_script("""
        import torch
        from tidepool import _state_tensors
        def device_bytes():
            return tidepool.stats(0)["tiering.vmm_device_bytes"]
        with tidepool.region("optimizer_state"):
            ranges = [malloc(2 * MiB) for _ in range(3)]
        made = device_bytes()  # new state goes where the budget puts it: two on the device
        def over(ptr):
            return torch.frombuffer((ctypes.c_char * (2 * MiB)).from_address(ptr),
                                    dtype=torch.uint8)
        _state_tensors._cuda_index = lambda tensor: 0  # they stand in for tensors on cuda:0
        mine = [over(ranges[0])[4096:], over(ranges[1]), torch.ones(4)]
        tidepool.evict(mine)
        tidepool.prefetch(over(ranges[2]))
        after_evict = device_bytes()
        # the second first: with the third on the device, the budget takes one more
        left = tidepool.prefetch(reversed(mine))
        print(json.dumps({"made": made, "after_evict": after_evict, "left": left,
                          "after_prefetch": device_bytes()}))
        """, "tidepool.state_budget:5MiB")).stdout.strip().splitlines()[-1])
    MiB = 1 << 20
    assert out == {"made": 4 * MiB, "after_evict": 2 * MiB, "left": 2 * MiB,
                   "after_prefetch": 4 * MiB}
