"""Takes into tiering optimizer state that no optimizer_state scope made.

Note [adopted state]: each state tensor on a CUDA device, at least tidepool.tier_min_bytes
and not in a pointer-stable range, is replaced where it is held by a copy made under the
optimizer_state tag, which lands in one (then the caller evicts, as after a step). Where
it is held may be deep: optimizer.state[p][key], or an item of a list or dict there
(LBFGS keeps its history as lists of tensors), changed in place so that whoever holds the
list sees the copies, or of a tuple, rebuilt. A tensor subclass other than a wrapper with
PyTorch's flatten protocol (FSDP2's DTensor, taken in through its local shard) is left as
it is: it is not one storage to copy. Nothing the state shares with the optimizer's
parameters or their gradients is copied (a view of a parameter kept in the state is the
parameter's memory), and tensors of the state that share a storage share one copy of
it, each at its own offset (_Copier). The copies are made one at a time, each old
tensor freed as its last reference goes (a shared storage once its last view is
replaced), so that adopting needs little device memory beyond the state. Two callers:
the wrapped load_state_dict (Note [loaded state] in _loaded_state.py) and the step
post-hook, for state a step made under workspace (Note [state made in workspace steps]
in _stray_state.py).
"""

from __future__ import annotations

import sys
import threading

from . import _install, _state_tensors, _step_scopes, _tags, _tiering


def _on_cuda(value) -> bool:
    return value.is_cuda


def tier_min_bytes() -> int:
    """tidepool.tier_min_bytes: smaller state tensors are never taken into tiering."""
    return (_install.STATE.config or {}).get("tier_min_bytes", 1 << 20)


def _tierable(part, min_bytes: int) -> bool:
    """Whether the plain tensor `part` is state tiering takes in: on a CUDA device and at
    least `min_bytes`."""
    return _on_cuda(part) and part.numel() * part.element_size() >= min_bytes


def holds_tierable(value, min_bytes: int) -> bool:
    """Whether `value` (a tensor, or a dict, list or tuple of them, nested) has a plain
    part tiering takes in (_tierable)."""
    return any(_tierable(part, min_bytes) for part in _state_tensors._parts_in(value))


def _adopt_tensor(value):
    """A copy of the plain tensor `value`, bit for bit, made under the scope
    adopt_stray_state opened, so in a pointer-stable range: in global mode with no state
    budget one backed by host memory, in chunks that are separate host-NUMA allocations
    (Note [Copies across host-NUMA mappings] in allocator/backends/cuda_backend.cpp).
    clone() would copy with cudaMemcpyAsync, the kind of copy across such allocations
    not known to be safe; so the copy is an elementwise kernel, which reads and writes
    through the mapping as the optimizer's own kernels do: a bitwise OR with 0 over the
    bits seen as integers of the element's width (exact for every value, -0.0 and NaN
    payloads included). An element width with no such integer (complex128), and a view
    whose values are its bits conjugated or negated (a lazy conj() or neg view), are
    cloned."""
    torch = _install.STATE.torch
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}.get(
        value.element_size())
    if bits is None or value.is_conj() or value.is_neg():
        return value.clone()
    out = torch.empty_like(value)
    torch.bitwise_or(value.view(bits), 0, out=out.view(bits))
    return out


def _adopted(value, copier):
    """`value` with every plain part the copier wants copied by it; a wrapper subclass is
    rebuilt around its copied parts. A DTensor keeps its own spec (mesh, placements,
    shard order: its __tensor_unflatten__ would rebuild the spec without the order);
    other wrappers are rebuilt by __tensor_unflatten__. A part that is neither a plain
    tensor nor a wrapper is kept as it is."""
    torch = _install.STATE.torch
    if type(value) is torch.Tensor:
        return copier.copy(value) if copier.wants(value) else value
    flat = _state_tensors._flatten(value)
    if flat is None:
        return value
    names, context = flat
    parts = {name: _adopted(getattr(value, name), copier) for name in names}
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


def _storage_key(part) -> tuple:
    return (_state_tensors._cuda_index(part), part.untyped_storage().data_ptr())


def _storage_users(part) -> int | None:
    """How many tensors (and storage objects) use the storage of `part`, the one made
    here to ask left out; None where this torch cannot say."""
    use_count = getattr(_install.STATE.torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    return use_count(part.untyped_storage()._cdata) - 1


def _held_elsewhere(values: dict, extra: set) -> set:
    """The ids of the tensors in `values` (id -> (tensor, places in the state holding it))
    referenced from more places than the state's (and, for those in `extra`, one more):
    their reference counts against a probe held the same way."""
    holder = [_install.STATE.torch.empty(0)]  # one place, as a tensor the state holds once
    values = dict(values)
    values[id(holder[0])] = (holder[0], 1)
    counts = {i: sys.getrefcount(value) - places - (i in extra)
              for i, (value, places) in values.items()}
    baseline = counts.pop(id(holder[0]))
    return {i for i, count in counts.items() if count > baseline}


class _Copier:
    """Note [adopted state]: which plain tensors of the state to copy, and the copying.
    A tensor is copied when its storage holds a tensor outside tiering (note): one on a
    CUDA device, at least min_bytes, not in a pointer-stable range, and not sharing its
    storage with a parameter or a gradient of the optimizers (a view of a parameter
    kept in the state is the parameter's memory: a copy would update nothing; those
    storages are taken out of `stray` after the walk, and only when it found some).
    Tensors sharing a storage stay sharing one: their storage is copied once, whole,
    and each is made a view of the copy with its own offset, sizes and strides (a
    tensor alone on its storage is cloned, compact).

    With `exclusive` (state a step made, Note [state made in workspace steps] in
    _stray_state.py), only what the state alone holds is copied: a copy of a tensor
    something else also holds (a tensor object referenced from outside the state, a
    storage other tensors view) would leave the two holders with different tensors,
    and their updates would no longer meet. What is shared stays where it is
    (`shared_bytes` says how much, per device). Loaded state is copied whatever else
    holds it: the holder is the checkpoint the load read, which PyTorch's own load
    leaves apart from the state too when it moves or casts it."""

    def __init__(self, min_bytes: int, exclusive: bool = False):
        self.min_bytes = min_bytes
        self.exclusive = exclusive
        self.views: dict = {}  # storage key -> plain tensors of the state on it (counted)
        self.stray: set = set()  # storage keys holding a tensor outside tiering
        self.nbytes: dict = {}   # storage key in `stray` -> the storage's bytes
        self.copies: dict = {}   # storage key -> its whole copy (bytes), made once
        # With `exclusive`: storage key -> (its users: tensors and storage objects, ids
        # of the tensors of the state on it and of the bases they view); id(value) ->
        # (value, places in the state holding it), for the tensors of the state.
        self.users: dict = {}
        self.values: dict = {}
        self.bases: set = set()  # ids of the tensors the state's views view
        self.shared_bytes: dict = {}  # device -> bytes of storages left shared
        self.copied: dict = {}        # device -> bytes copied

    def note(self, value) -> None:
        """During the walk: each plain part of the tensor `value` on a CUDA device."""
        noted = False
        for part in _state_tensors._plain_parts(value):
            if not _on_cuda(part) or part.numel() == 0:
                continue
            key = _storage_key(part)
            self.views[key] = self.views.get(key, 0) + 1
            if _tierable(part, self.min_bytes) and not _tiering.owns(key[0], part.data_ptr()):
                self.stray.add(key)
                self.nbytes[key] = part.untyped_storage().nbytes()
            if self.exclusive:
                noted = True
                users, ids = self.users.get(key, (None, set()))
                ids.add(id(part))
                if part._base is not None:
                    ids.add(id(part._base))
                    self.bases.add(id(part._base))
                self.users[key] = (_storage_users(part) if users is None else users, ids)
        if noted:
            held = self.values.get(id(value))
            self.values[id(value)] = (value, 1 if held is None else held[1] + 1)

    def keep_shared(self) -> None:
        """With `exclusive`, after the walk: drops from `stray` each storage something
        outside the state also holds (a tensor other than the state's and the bases they
        view, or a tensor object of the state referenced from elsewhere)."""
        if not self.exclusive or not self.stray:
            return
        shared = {key for key, (users, ids) in self.users.items()
                  if users is not None and users > len(ids)}
        # A tensor other tensors view is held from C++ too (their view information), and
        # PyTorch then holds its Python object once more (PyObject preservation).
        held_elsewhere = _held_elsewhere(self.values, self.bases)
        for value, _ in self.values.values():
            if id(value) in held_elsewhere:
                shared.update(_storage_key(part) for part in _state_tensors._plain_parts(value)
                              if _on_cuda(part) and part.numel() > 0)
        for key in shared & self.stray:
            self.stray.discard(key)
            self.shared_bytes[key[0]] = self.shared_bytes.get(key[0], 0) + self.nbytes[key]

    def _count(self, device, copied: int) -> None:
        self.copied[device] = self.copied.get(device, 0) + copied

    def wants(self, value) -> bool:
        """After the walk: whether some plain part of `value` is to be copied."""
        return any(_on_cuda(part) and part.numel() > 0 and _storage_key(part) in self.stray
                   for part in _state_tensors._plain_parts(value))

    def copy(self, part):
        """The adopted copy of the plain tensor `part`, which `wants`."""
        key = _storage_key(part)
        if self.views.get(key, 0) < 2:
            self._count(key[0], part.numel() * part.element_size())
            return _adopt_tensor(part)
        torch = _install.STATE.torch
        whole = self.copies.get(key)
        if whole is None:
            storage = torch.empty(0, dtype=torch.uint8, device=part.device)
            whole = self.copies[key] = _adopt_tensor(storage.set_(part.untyped_storage()))
            self._count(key[0], whole.numel())
        view = torch.empty(0, dtype=part.dtype, device=part.device)
        return view.set_(whole.untyped_storage(), part.storage_offset(), part.size(),
                         part.stride())


def _walk(container, key, copier: _Copier | None, leaves: list) -> None:
    """Appends to `leaves` the (container, key) of each tensor under container[key], and
    of each tuple holding one (immutable: rebuilt whole), noting their parts in `copier`
    (unless None). Dicts and lists are walked, so that their items can be replaced where
    they are and whoever holds the list (LBFGS's old_dirs) sees the copies."""
    value = container[key]
    if isinstance(value, dict):
        for k in list(value):
            _walk(value, k, copier, leaves)
    elif isinstance(value, list):
        for i in range(len(value)):
            _walk(value, i, copier, leaves)
    elif isinstance(value, tuple):
        inner: list = []
        for i in range(len(value)):
            _walk(value, i, copier, inner)
        if inner:
            leaves.append((container, key))
    elif isinstance(value, _install.STATE.torch.Tensor):
        if copier is not None:
            copier.note(value)
        leaves.append((container, key))


def _adopt_place(container, key, copier: _Copier) -> None:
    """Replaces container[key] (a place StrayState holds) by its adopted copy: a
    tensor's wanted parts copied (a wrapper rebuilt around them, _adopted), a tuple
    rebuilt around its items with each of its places adopted in turn."""
    value = container[key]
    if isinstance(value, tuple):
        items = list(value)
        inner: list = []
        for i in range(len(items)):
            _walk(items, i, None, inner)
        for c, k in inner:
            if isinstance(c[k], tuple) or copier.wants(c[k]):
                _adopt_place(c, k, copier)
        container[key] = type(value)._make(items) if hasattr(type(value), "_make") \
            else type(value)(items)
        return
    container[key] = _adopted(value, copier)


class StrayState:
    """What stray_state found: `places`, the (container, key) pairs holding state to
    copy, and the copier that copies it."""

    def __init__(self, places: list, copier: _Copier):
        self.places = places
        self.copier = copier

    def __len__(self) -> int:
        return len(self.places)


def _kept_storages(optimizers: list) -> set:
    """The storage keys of the optimizers' parameters and their gradients on CUDA devices."""
    torch = _install.STATE.torch
    kept = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for p in group["params"]:
                for t in (p, p.grad):
                    # A sparse gradient has no storage the state could share.
                    if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                        for part in _state_tensors._plain_parts(t, any_tensor=True):
                            if _on_cuda(part) and part.numel() > 0:
                                kept.add(_storage_key(part))
    return kept


def stray_state(optimizers: list, exclusive: bool = False) -> StrayState:
    """Note [adopted state]: the places in the optimizers' state (every entry of
    optimizer.state, through nested dicts, lists and tuples) that hold a tensor to copy
    (_Copier; with `exclusive`, only what the state alone holds), as (container, key)
    pairs."""
    copier = _Copier(tier_min_bytes(), exclusive)
    leaves: list = []
    for optimizer in optimizers:
        state = optimizer.state
        for key in list(state):
            _walk(state, key, copier, leaves)
    if copier.stray:  # only then is the walk over the parameters worth it
        copier.stray -= _kept_storages(optimizers)
    copier.keep_shared()
    if not copier.stray:
        return StrayState([], copier)
    return StrayState([(c, k) for c, k in leaves
                       if isinstance(c[k], tuple) or copier.wants(c[k])], copier)


def adopt_stray_state(optimizers: list, own: list[int], stray: StrayState, why: str) -> int:
    """Note [adopted state]: replaces what each of stray's places (stray_state) holds by
    copies made under the optimizer_state tag (in pool mode, in the tidepool MemPool of
    each device a copy is made on, also one an enclosing scope holds: Note [only state
    steps enter the pool] in _step_scopes.py), one at a time, so that the old copy is
    freed as its last reference goes before the next is made; the scope holds `own`
    (devices no open scope holds). Returns the bytes taken in, which stats() counts
    under `why` ("after_step" or "on_load"). The caller evicts."""
    if not stray:
        return 0
    depth = len(_step_scopes._scopes())
    pooled = sorted(set(own) | {key[0] for key in stray.copier.stray})
    _step_scopes._begun(own, lambda: _step_scopes._open_scope(own, _tags.OPTIMIZER_STATE,
                                                              optimizers=list(optimizers),
                                                              pooled=pooled))
    try:
        with _install.STATE.torch.no_grad():  # copies of state, not steps of a graph
            for container, key in stray.places:
                _adopt_place(container, key, stray.copier)
    finally:
        _step_scopes._close_scopes_down_to(depth)
        _count_copied(why, stray.copier.copied)
    return sum(stray.copier.copied.values())


# stats(): device -> {key: value}, process-wide, under _totals_lock (steps on several
# threads adopt at once).
_totals: dict = {}
_totals_lock = threading.Lock()


def _count_copied(why: str, copied: dict) -> None:
    with _totals_lock:
        for device, n in copied.items():
            totals = _totals.setdefault(device, {})
            key = f"hooks.state_adopted_{why}_bytes"
            totals[key] = totals.get(key, 0) + n
            totals["hooks.num_state_adoptions"] = totals.get("hooks.num_state_adoptions", 0) + 1


def stats(device: int) -> dict:
    """Note [adopted state]: tidepool.stats() keys of `device`, since the start: the bytes
    of optimizer state copied into tiering after steps (hooks.state_adopted_after_step_
    bytes) and after loads (hooks.state_adopted_on_load_bytes), and how many steps and
    loads copied some (hooks.num_state_adoptions)."""
    keys = ("hooks.state_adopted_after_step_bytes", "hooks.state_adopted_on_load_bytes",
            "hooks.num_state_adoptions")
    with _totals_lock:
        totals = _totals.get(device, {})
        return {key: totals.get(key, 0) for key in keys}
