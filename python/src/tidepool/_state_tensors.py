"""The plain tensors of an optimizer's state and where they are: the CUDA devices of its
parameters, the plain tensors behind a value (a wrapper subclass's, such as FSDP2's
DTensor's local shard, through PyTorch's flatten protocol), and the data pointers of its
state on each device in the order its step uses them. The step hooks name state by these
pointers (Note [prefetch by pointer] in _state_moves.py), and so do tidepool.evict and
tidepool.prefetch (_by_pointer.py) and the adoption of loaded state (_loaded_state.py):
one walk, so that all of them name the same tensors.

Other modules call _cuda_devices and _cuda_index through this module, not imported by
name, so that the tests can stand in for CUDA devices by replacing them here.
"""

from __future__ import annotations

import sys

from . import _install


def _cuda_devices(optimizer) -> list[int]:
    devices = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.is_cuda:
                devices.add(p.device.index)
    return sorted(devices)


def _cuda_index(tensor) -> int:
    """The index of the CUDA device `tensor` is on; -1 when it is on none."""
    return tensor.get_device() if tensor.is_cuda else -1


def _parts_in(value):
    """Yields each plain tensor (_plain_parts: a DTensor's local shard) in `value`, a
    tensor or a dict, list or tuple of them (LBFGS keeps lists of tensors), nested, in
    order; anything else in it yields nothing."""
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        yield from _plain_parts(value)
        return
    for item in value:
        yield from _parts_in(item)


def _add_pointers(value, by_device: dict) -> None:
    """Appends to by_device[d] the data pointer of each plain tensor in `value`
    (_parts_in) on CUDA device d."""
    for part in _parts_in(value):
        d = _cuda_index(part)
        if d >= 0:
            by_device.setdefault(d, []).append(part.data_ptr())


def _state_pointers(optimizer, every_parameter: bool) -> dict[int, list[int]]:
    """Note [prefetch by pointer] in _state_moves.py: device -> the data pointers of the
    optimizer's state tensors on it, parameter by parameter in param_groups order (the
    order its step uses them), then the state under keys that are no parameter of a
    group. Unless `every_parameter`, only the state of parameters with a gradient."""
    by_device: dict[int, list[int]] = {}
    state = optimizer.state
    found = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            param_state = state.get(p)
            if param_state is not None:
                found += 1
                if every_parameter or p.grad is not None:
                    _add_pointers(param_state, by_device)
    if found < len(state):  # a custom optimizer's state under keys of its own
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for key, value in state.items():
            if id(key) not in params:
                _add_pointers(value, by_device)
    return by_device


def _pointers_of(optimizers: list) -> dict[int, list[int]]:
    """device -> the pointers of the optimizers' state tensors (_state_pointers, every
    parameter's), one optimizer after the other."""
    by_device: dict[int, list[int]] = {}
    for optimizer in optimizers:
        for d, ptrs in _state_pointers(optimizer, every_parameter=True).items():
            by_device.setdefault(d, []).extend(ptrs)
    return by_device


def _flatten(value):
    """(inner tensor names, context) of a wrapper subclass that implements PyTorch's
    flatten protocol (__tensor_flatten__, as FSDP2's DTensor does); None for anything else."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    return value.__tensor_flatten__() if is_traceable_wrapper_subclass(value) else None


def _plain_parts(value, any_tensor: bool = False) -> list:
    """The plain tensors holding `value`'s data: itself (if strided), or a wrapper's
    (_flatten) inner tensors, recursively. [] for anything else (nn.Parameter, other
    subclasses, sparse tensors), unless `any_tensor`: then a tensor of any other subclass
    or layout is its own part (a user's nn.Parameter handed to tidepool.evict). (Also
    reached by tidepool.evict(), where tidepool may be installed in no torch: under the
    LD_PRELOAD shim.)"""
    torch = _install.STATE.torch or sys.modules["torch"]
    if type(value) is torch.Tensor:
        # A sparse (or other non-strided) tensor has no storage of its own to name or move
        # (nn.Embedding(sparse=True): its gradient, and SGD's momentum buffer cloned from
        # it): none of the state's, left where it is; tidepool.evict of one says so.
        return [value] if any_tensor or value.layout == torch.strided else []
    flat = _flatten(value)
    if flat is None:
        return [value] if any_tensor and isinstance(value, torch.Tensor) else []
    return [part for name in flat[0] for part in _plain_parts(getattr(value, name), any_tensor)]
