"""The tiering layer's C ABI replaced by a recorder, for the tests of the optimizer step
hooks and of tidepool.evict / prefetch on a machine without a GPU (test_optim_hooks.py,
test_optim_hooks_threads.py, test_evict_prefetch_by_state.py): `fake_tiering` records
each move and makes every tensor count as on CUDA device 0; EVICT, prefetch_of and
evict_ptrs_of are the moves the hooks make."""

from __future__ import annotations

import pytest
import torch

from tidepool import _in_flight, _state_moves, _state_tensors, _tags, _tiering


@pytest.fixture
def fake_tiering(monkeypatch):
    """Records the moves: ("prefetch", device, pointers, stream), ("evict", device, tag,
    stream) and ("evict_ptrs", device, pointers, stream); a prefetch leaves nothing on the
    host. Every tensor counts as on CUDA device 0. Afterwards no step may be left counted
    in flight (Note [steps in flight])."""
    moves = []
    monkeypatch.setattr(_tiering, "available", lambda: True)
    monkeypatch.setattr(_tiering, "prefetch_tag",
                        lambda d, tag, stream: moves.append(("prefetch_tag", d, tag, stream)) or 0)
    monkeypatch.setattr(_tiering, "prefetch_ptrs",
                        lambda d, ptrs, stream:
                            moves.append(("prefetch", d, tuple(ptrs), stream)) or 0)
    monkeypatch.setattr(_tiering, "evict_tag",
                        lambda d, tag, stream: moves.append(("evict", d, tag, stream)))
    monkeypatch.setattr(_tiering, "evict_ptrs",
                        lambda d, ptrs, stream:
                            moves.append(("evict_ptrs", d, tuple(ptrs), stream)))
    # Note [state outside optimizer.state]: no range beyond the state the hooks name,
    # unless a test says otherwise.
    monkeypatch.setattr(_tiering, "device_ranges_except", lambda d, tag, ptrs: [])
    monkeypatch.setattr(_tiering, "owns", lambda d, ptr: False)
    monkeypatch.setattr(_tiering, "range_ids", lambda d, ptrs: [0] * len(ptrs))
    monkeypatch.setattr(_state_tensors, "_cuda_devices", lambda optimizer: [0])
    monkeypatch.setattr(_state_tensors, "_cuda_index", lambda tensor: 0)
    monkeypatch.setattr(_state_moves, "_stream", lambda torch, d: 4242)
    yield moves
    assert _in_flight.in_flight() == {}, "a step is still counted in flight"


EVICT = ("evict", 0, _tags.OPTIMIZER_STATE, 4242)


def state_pointers(*optimizers) -> tuple:
    """The optimizers' state tensors' pointers, parameter by parameter in param_groups
    order, one optimizer after the other."""
    return tuple(value.data_ptr() for optimizer in optimizers
                 for group in optimizer.param_groups for p in group["params"]
                 for value in optimizer.state.get(p, {}).values()
                 if isinstance(value, torch.Tensor))


def prefetch_of(*optimizers):
    """The prefetch the pre-hook makes for the optimizers' state, stepped together (one
    nested in the other)."""
    return ("prefetch", 0, state_pointers(*optimizers), 4242)


def evict_ptrs_of(*optimizers):
    """The eviction by pointer of a step that ends while another thread's is in flight:
    its optimizer's state, then that of the optimizers stepped inside it."""
    return ("evict_ptrs", 0, state_pointers(*optimizers), 4242)
