"""Takes into tiering optimizer state that no optimizer_state scope made.

Note [adopted state]: each state tensor on a CUDA device, at least tidepool.tier_min_bytes
and not in a pointer-stable range, is replaced where it is held by a copy made under the
optimizer_state tag, which lands in one (then the caller evicts, as after a step). Where
it is held may be deep: optimizer.state[p][key], or an item of a list or dict there
(LBFGS keeps its history as lists of tensors), changed in place so that whoever holds the
list sees the copies, or of a tuple, rebuilt. A tensor subclass other than a wrapper with
PyTorch's flatten protocol (FSDP2's DTensor, taken in through its local shard) is left as
it is: it is not one storage to copy. The copies are made one at a time, each old tensor
freed as its last reference goes, so that adopting costs the device one tensor's bytes
at most beyond the state. Two callers: the wrapped load_state_dict (Note [loaded state]
in _loaded_state.py) and the step post-hook, for state a step made under workspace (Note
[state made in workspace steps] in _stray_state.py).
"""

from __future__ import annotations

from . import _install, _state_tensors, _step_scopes, _tags, _tiering


def _on_cuda(value) -> bool:
    return value.is_cuda


def _adopt_tensor(value):
    """A copy of the plain tensor `value`, made under the scope adopt_stray_state opened."""
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
    """Some plain part of the tensor `value` is on a CUDA device, at least min_bytes, and
    not in a pointer-stable range."""
    return any(_on_cuda(part) and part.numel() * part.element_size() >= min_bytes
               and not _tiering.owns(part.device.index, part.data_ptr())
               for part in _state_tensors._plain_parts(value))


def _stray_places(container, key, min_bytes: int, found: list) -> None:
    """Note [adopted state]: appends (container, key) for each place under
    container[key] that holds a tensor outside tiering: the tensor's own place, or, for a
    tuple (immutable), the tuple's place, rebuilt whole. Dicts and lists are walked and
    their items replaced where they are, so that whoever holds the list (LBFGS's
    old_dirs) sees the copies."""
    value = container[key]
    if isinstance(value, dict):
        for k in list(value):
            _stray_places(value, k, min_bytes, found)
    elif isinstance(value, list):
        for i in range(len(value)):
            _stray_places(value, i, min_bytes, found)
    elif isinstance(value, tuple):
        inner: list = []
        for i in range(len(value)):
            _stray_places(value, i, min_bytes, inner)
        if inner:
            found.append((container, key))
    elif _outside_tiering(value, min_bytes):
        found.append((container, key))


def _adopt_place(container, key, min_bytes: int) -> int:
    """Replaces container[key] (a place from _stray_places) by its adopted copy: a
    tensor's parts copied by _adopted, a tuple rebuilt around its items with each of its
    stray places adopted in turn. Returns the bytes copied."""
    value = container[key]
    if isinstance(value, tuple):
        items = list(value)
        places: list = []
        for i in range(len(items)):
            _stray_places(items, i, min_bytes, places)
        copied = sum(_adopt_place(place, k, min_bytes) for place, k in places)
        container[key] = type(value)._make(items) if hasattr(type(value), "_make") \
            else type(value)(items)
        return copied
    copied = sum(part.numel() * part.element_size()
                 for part in _state_tensors._plain_parts(value))
    container[key] = _adopted(value)
    return copied


def stray_state(optimizers: list) -> list:
    """Note [adopted state]: the places in the optimizers' state (every entry of
    optimizer.state, through nested dicts, lists and tuples) that hold a tensor outside
    tiering, as (container, key) pairs."""
    min_bytes = (_install.STATE.config or {}).get("tier_min_bytes", 1 << 20)
    found: list = []
    for optimizer in optimizers:
        state = optimizer.state
        for key in list(state):
            _stray_places(state, key, min_bytes, found)
    return found


def adopt_stray_state(optimizers: list, own: list[int], places: list) -> int:
    """Note [adopted state]: replaces what each of `places` (from stray_state) holds by
    copies made under the optimizer_state tag (in pool mode, in the tidepool MemPool of
    each device in `own`: devices no open scope holds), one at a time, so that the old
    copy is freed as its last reference goes before the next is made. Returns the bytes
    taken in. The caller evicts."""
    if not places:
        return 0
    min_bytes = (_install.STATE.config or {}).get("tier_min_bytes", 1 << 20)
    adopted = 0
    depth = len(_step_scopes._scopes())
    _step_scopes._begun(own, lambda: _step_scopes._open_scope(own, _tags.OPTIMIZER_STATE,
                                                              optimizers=list(optimizers)))
    try:
        with _install.STATE.torch.no_grad():  # copies of state, not steps of a graph
            for container, key in places:
                adopted += _adopt_place(container, key, min_bytes)
    finally:
        _step_scopes._close_scopes_down_to(depth)
    return adopted
