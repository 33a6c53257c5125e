"""Takes in the optimizer state that Optimizer.load_state_dict creates outside step()
(Note [loaded state]): state on a CUDA device that no step scope tagged is copied into
pointer-stable optimizer_state ranges and evicted as after a step, so that resuming
from a checkpoint does not leave it resident on the device. The install wraps
load_state_dict with this (register in _optim_hooks.py).
"""

from __future__ import annotations

from . import _install, _state_moves, _state_tensors, _step_scopes, _tags, _tiering


def _on_cuda(value) -> bool:
    return value.is_cuda


def _adopt_tensor(value):
    """A copy of the plain tensor `value`, made under the scope _adopt_loaded_state opened."""
    return value.clone()


def _adopted(value):
    """`value` with every plain part copied by _adopt_tensor; a wrapper subclass is
    rebuilt around its copied parts. A DTensor keeps its own spec (mesh, placements,
    shard order: its __tensor_unflatten__ would rebuild the spec without the order);
    other wrappers are rebuilt by __tensor_unflatten__. A part that is neither a plain
    tensor nor a wrapper is kept as it is."""
    torch = _install.STATE.torch
    if type(value) is torch.Tensor:
        return _adopt_tensor(value)
    flat = _state_tensors._flatten(value)
    if flat is None:
        return value
    names, context = flat
    parts = {name: _adopted(getattr(value, name)) for name in names}
    dtensor = _dtensor_class()
    if dtensor is not None and type(value) is dtensor:
        return dtensor(parts["_local_tensor"], value._spec, requires_grad=value.requires_grad)
    return type(value).__tensor_unflatten__(parts, context, value.size(), value.stride())


def _dtensor_class():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed
        return None
    return DTensor


def _outside_tiering(value, min_bytes: int) -> bool:
    """Some plain part of `value` is on a CUDA device, at least min_bytes, and not in a
    pointer-stable range."""
    return any(_on_cuda(part) and part.numel() * part.element_size() >= min_bytes
               and not _tiering.owns(part.device.index, part.data_ptr())
               for part in _state_tensors._plain_parts(value))


def _adopt_loaded_state(optimizer) -> int:
    """Note [loaded state]: optimizer.load_state_dict (resuming from a checkpoint) creates
    the state outside step(), so no step scope tags it: state tensors moved to the device
    by the load (map_location="cpu"), or loaded onto it directly (map_location="cuda"),
    would be ordinary device memory, resident for the rest of the run: a model that only
    fits with its state off the device would run out of memory on resuming. So after the
    load every state tensor that tidepool would have made pointer-stable (on a CUDA
    device, at least tidepool.tier_min_bytes, not already in a tiered range) is copied
    into one under the optimizer_state tag, as a step would have made it, and the state
    is evicted as after a step. A wrapper subclass with PyTorch's flatten protocol
    (FSDP2's DTensor state) is taken in through its plain inner tensors (_plain_parts);
    other subclasses are left as they are. Returns the bytes taken in."""
    devices = _state_tensors._cuda_devices(optimizer)
    if not devices or not _state_moves._tiering_or_warn():
        return 0
    min_bytes = (_install.STATE.config or {}).get("tier_min_bytes", 1 << 20)
    stray = [(state, key) for state in optimizer.state.values() for key, value in state.items()
             if _outside_tiering(value, min_bytes)]
    if not stray:
        return 0
    adopted = 0
    depth = len(_step_scopes._scopes())
    own = _step_scopes._devices_not_held(devices)
    _step_scopes._begun(own, lambda: _step_scopes._open_scope(own, _tags.OPTIMIZER_STATE,
                                                              optimizers=[optimizer]))
    try:
        with _install.STATE.torch.no_grad():  # copies of state, not steps of a graph
            for state, key in stray:
                value = state[key]
                state[key] = _adopted(value)  # the old copy is freed as the last reference goes
                adopted += sum(part.numel() * part.element_size()
                               for part in _state_tensors._plain_parts(value))
    finally:
        _step_scopes._close_scopes_down_to(depth)
    _state_moves._evict(own, [optimizer])
    return adopted
