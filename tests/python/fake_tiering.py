"""The tiering layer's C ABI replaced by a recorder, for the tests of the optimizer step
hooks and of tidepool.evict / prefetch on a machine without a GPU (test_optim_hooks.py,
test_optim_hooks_threads.py, test_evict_prefetch_by_state.py, test_stray_state.py):
`fake_tiering` records each move and makes every tensor count as on CUDA device 0;
EVICT, prefetch_of and evict_ptrs_of are the moves the hooks make. `untiered_state`
adds where tensors are: CPU tensors stand in for CUDA ones, in a pointer-stable range
when made under the optimizer_state tag, as in global mode."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree
from torch.utils._python_dispatch import TorchDispatchMode

from tidepool import _adoption, _in_flight, _state_moves, _state_tensors, _tags, _tiering


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
    # The C side's count too (Note [Steps of other threads]): every begin had its end.
    assert _tiering._fn("tidepool_steps_in_flight")(0) == 0, "a step still counted in C"


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


def state_tensors(value, min_bytes: int = 0) -> list[torch.Tensor]:
    """Every tensor of at least min_bytes in a state value: a tensor, or a dict, list or
    tuple of them, nested (LBFGS keeps lists), in order."""
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in state_tensors(item, min_bytes)]
    if isinstance(value, torch.Tensor) and value.numel() * value.element_size() >= min_bytes:
        return [value]
    return []


class _PlacedByTag(TorchDispatchMode):
    """Global mode's placement, on the CPU: the memory each op allocates (an output that
    is no view or in-place result of its inputs) while the thread's tag is
    optimizer_state counts as a pointer-stable range; a wrapper's (DTensor's) inner
    tensors count for it. The range keeps its storage alive, so that no tensor made
    later outside the tag takes its address."""

    def __init__(self, ranges: dict):
        super().__init__()
        self.ranges = ranges

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if _tags.current() == _tags.OPTIMIZER_STATE:
            results = out if isinstance(out, (tuple, list)) else (out,)
            for result, schema in zip(results, func._schema.returns):
                if schema.alias_info is None:
                    for part in _parts(_pytree.tree_leaves(result)):
                        storage = part.untyped_storage()
                        self.ranges[storage.data_ptr()] = (storage.nbytes(), storage)
        return out


def _parts(leaves) -> list:
    """The strided tensors behind `leaves` (a sparse one's memory is not modelled)."""
    return [part for leaf in leaves if isinstance(leaf, torch.Tensor)
            for part in _state_tensors._plain_parts(leaf, any_tensor=True)
            if part.layout == torch.strided]


class Placement:
    """What `untiered_state` gives a test: `adopted_under`, the tag in force at each copy
    the adoption made (Note [adopted state]), and `tiered(tensor)`."""

    def __init__(self):
        self.adopted_under: list[int] = []
        self.ranges: dict = {}  # base address -> (bytes, the storage, kept alive)

    def owns(self, device, ptr) -> bool:
        return any(base <= ptr < base + size for base, (size, _) in self.ranges.items())

    def tiered(self, tensor) -> bool:
        return all(self.owns(0, part.data_ptr()) for part in _state_tensors._plain_parts(tensor))


@pytest.fixture
def untiered_state(monkeypatch, fake_tiering):
    """Every tensor stands in for one on CUDA device 0; one made under the optimizer_state
    tag (a step that may create state, or the adoption's copy) counts as in a
    pointer-stable range (_PlacedByTag); any other is ordinary device memory."""
    placement = Placement()

    def adopt(value):
        placement.adopted_under.append(_tags.current())
        return value.clone()

    monkeypatch.setattr(_adoption, "_on_cuda", lambda value: True)
    monkeypatch.setattr(_adoption, "_adopt_tensor", adopt)
    monkeypatch.setattr(_tiering, "owns", placement.owns)
    with _PlacedByTag(placement.ranges):
        yield placement
