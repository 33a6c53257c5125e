"""Global torch.optim step hooks: the optimizer state any torch.optim optimizer creates
inside step() is tagged optimizer_state (see Note [step tags]); before each step it is prefetched, after each
step it is evicted to host memory (pointer-stable, so AdamW's foreach and fused paths
keep their tensors and notice nothing).

Whether the pre-hook prefetches depends on tidepool.state_budget, see Note [state budget 0].
The pre-hook opens a scope (tag push, and in pool mode the tidepool MemPool for each
device the optimizer's parameters live on); the post-hook closes it. See Note [a step
that raises] for what closes it when step() raises, and Note [closures] for the closure
of step(closure), which runs outside it.

State that appears outside step() is taken in too: Optimizer.load_state_dict (resuming
from a checkpoint) is wrapped, see Note [loaded state].
"""

from __future__ import annotations

import functools
import threading
import warnings

from . import _install, _patches, _tags, _tiering

_local = threading.local()
_warned_no_tiering = False


def _cuda_devices(optimizer) -> list[int]:
    devices = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.is_cuda:
                devices.add(p.device.index)
    return sorted(devices)


def _step_tag(optimizer) -> int:
    """Note [step tags]: a step that creates state (a parameter with a gradient has none
    yet: the first step, or parameters added later) runs under optimizer_state, so the
    state lands in pointer-stable, evictable ranges. Later steps run under workspace:
    their allocations are the foreach/fused temporaries, freed before step() returns,
    and need no migratable (slower to create) ranges."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not optimizer.state.get(p):
                return _tags.OPTIMIZER_STATE
    return _tags.WORKSPACE


def _stream(torch, device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _tiering_or_warn() -> bool:
    global _warned_no_tiering
    if _tiering.available():
        return True
    if not _warned_no_tiering and (_install.STATE.config or {}).get("log") != "off":
        warnings.warn("tidepool: this build has no optimizer-state tiering; optimizer state "
                      "is tagged but stays on the device", _install.TidepoolInactiveWarning)
        _warned_no_tiering = True
    return False


def _state_budget_allows_prefetch() -> bool:
    """Note [state budget 0]: with no device budget for optimizer state (the default)
    nothing is prefetched: the evicted state stays in host memory and the step's kernels
    reach it in place through the pointer-stable mapping (~82 GB/s on the H200, about
    the rate a prefetch+evict round trip would move it at), so the state never occupies
    device memory between or during steps. With a budget, the state is prefetched
    before the step as far as it fits in the budget (the tiering layer stops there; the
    rest is used in host memory)."""
    budget = (_install.STATE.config or {}).get("state_budget", {"kind": "bytes", "bytes": 0})
    return not (budget.get("kind") == "bytes" and budget.get("bytes", 0) == 0)


def _scopes() -> list:
    """This thread's open step scopes, innermost last: (devices, MemPool contexts)."""
    scopes = getattr(_local, "scopes", None)
    if scopes is None:
        scopes = _local.scopes = []
    return scopes


def _guarded_steps() -> list[int]:
    """The guarded steps running on this thread, innermost last: each one's scope depth
    when it began (its pre-hook's scope, once open, is at that index)."""
    steps = getattr(_local, "guarded_steps", None)
    if steps is None:
        steps = _local.guarded_steps = []
    return steps


def _close_scope() -> list[int]:
    """Closes the innermost scope; returns its devices ([] when none is open)."""
    scopes = _scopes()
    if not scopes:
        return []
    devices, pool_contexts = scopes.pop()
    _tags.pop()
    for context in reversed(pool_contexts):
        context.__exit__(None, None, None)
    return devices


def _close_scopes_down_to(depth: int) -> list[int]:
    """Closes scopes until `depth` are left; returns the devices of those it closed."""
    devices: set[int] = set()
    while len(_scopes()) > depth:
        devices.update(_close_scope())
    return sorted(devices)


def _devices_not_held(devices: list[int]) -> list[int]:
    """Those of `devices` no open scope holds: a nested step (a subclass's step() calling
    its base's, both wrapped by torch with the hooks, or one optimizer stepping another)
    moves state and enters pools only for those, since evicting or prefetching the tag
    covers all of a device's state and the enclosing step still runs after the nested
    one."""
    held = {d for scope_devices, _ in _scopes() for d in scope_devices}
    return [d for d in devices if d not in held]


def _open_scope(own: list[int], tag: int) -> None:
    """Allocations of this thread go under `tag` (and, in pool mode, to the tidepool
    MemPool of each device in `own`, from _devices_not_held) until _close_scope, which
    returns `own`."""
    torch = _install.STATE.torch
    contexts = []
    pool = _install.pool()
    if pool is not None:
        for d in own:
            context = torch.cuda.use_mem_pool(pool, d)
            context.__enter__()
            contexts.append(context)
    _tags.push(tag)
    _scopes().append((own, contexts))


def _guard_step(hooked_step):
    """Note [a step that raises]: torch runs no post-hook when step() raises (nor when a
    pre-hook or post-hook does), so the scope tidepool's pre-hook opened would stay
    open: in pool mode every allocation that follows (the next forward pass of a loop
    that catches the error, e.g. an out-of-memory retry) would go to tidepool's pool
    under the step's tag, and state prefetched for the step would stay on the device.
    So the install wraps torch's step patcher (Optimizer.profile_hook_step, which wraps
    each optimizer class's step() once with the hooks) to put this guard around what it
    returns, hooks included: when the call raises, the guard closes the scopes opened
    since it began (its pre-hook's, and any a nested step left), evicts the state on
    their devices as the post-hook would have, and lets the error go on.

    Scopes nest: each guarded step's pre-hook keeps the scopes below the depth at which
    its step began (an enclosing step's, guarded or not) and closes any above it (left
    by an unguarded step that raised). An optimizer class whose step() torch wrapped
    before tidepool was installed has no guard; its pre-hook keeps the scopes of the
    guarded steps running around it and closes the rest, so a scope such a step left
    when it raised is closed by the next step on the thread."""

    @functools.wraps(hooked_step)
    def guarded_step(*args, **kwargs):
        steps = _guarded_steps()
        base = len(_scopes())
        steps.append(base)
        try:
            return hooked_step(*args, **kwargs)
        except BaseException:
            devices = _close_scopes_down_to(base)
            if devices and _tiering.available():
                try:
                    _evict(devices)
                except Exception as evict_error:  # the step's own error is the one to raise
                    warnings.warn(f"tidepool: evicting optimizer state after a step that raised "
                                  f"failed: {evict_error}", _install.TidepoolInactiveWarning)
            raise
        finally:
            steps.pop()

    guarded_step.tidepool_guarded = True
    return guarded_step


def _scopes_to_keep() -> int:
    """How many open scopes belong to steps still running around this pre-hook's step
    (see _guard_step); the ones above are left by a step that raised unguarded. The
    innermost guarded step's own pre-hook finds exactly its base open (its scope is not
    yet); a step nested inside it finds that scope too, and keeps it."""
    steps = _guarded_steps()
    return min(len(_scopes()), steps[-1] + 1) if steps else 0


def _evict(devices: list[int]) -> None:
    torch = _install.STATE.torch
    for d in devices:
        _tiering.evict_tag(d, _tags.OPTIMIZER_STATE, _stream(torch, d))


def _closure_outside_the_scope(optimizer, closure, index: int):
    """Note [closures]: step(closure) calls the closure inside step(), so inside the
    scope the pre-hook opened: its forward and backward would run under the step's tag
    (in pool mode, in tidepool's MemPool), and the tag, decided before the closure made
    any gradient, would be workspace on the first step (_step_tag finds no gradient), so
    the state the step then creates would not be tiered. The pre-hook hands torch this
    wrapper instead: while the closure runs, the step's scope (at `index`) is closed,
    so the closure allocates as the caller would outside the step; after it, the scope
    opens again under the tag decided now, with the gradients there. An optimizer that
    calls the closure several times (LBFGS) gets this around each call. Nothing moves:
    the state stays where the pre-hook put it."""

    @functools.wraps(closure)
    def closure_outside_the_scope(*args, **kwargs):
        scopes = _scopes()
        if len(scopes) != index + 1:  # not the step's own scope on top: run it as it is
            return closure(*args, **kwargs)
        devices = _close_scope()
        try:
            return closure(*args, **kwargs)
        finally:
            _open_scope(devices, _step_tag(optimizer))

    return closure_outside_the_scope


def _with_closure_wrapped(optimizer, args, kwargs, index: int):
    """(args, kwargs) with step()'s closure (positional or keyword) wrapped by
    _closure_outside_the_scope; None when there is no closure. torch hands the hooks
    step()'s arguments with the optimizer first: the closure is args[1]."""
    if len(args) > 1 and callable(args[1]):
        wrapped = _closure_outside_the_scope(optimizer, args[1], index)
        return ((args[0], wrapped, *args[2:]), kwargs)
    if callable(kwargs.get("closure")):
        return (args, {**kwargs,
                       "closure": _closure_outside_the_scope(optimizer, kwargs["closure"], index)})
    return None


def _pre_step(optimizer, args, kwargs):
    torch = _install.STATE.torch
    _close_scopes_down_to(_scopes_to_keep())
    devices = _devices_not_held(_cuda_devices(optimizer))
    if devices and _tiering_or_warn() and _state_budget_allows_prefetch():
        for d in devices:
            _tiering.prefetch_tag(d, _tags.OPTIMIZER_STATE, _stream(torch, d))
    _open_scope(devices, _step_tag(optimizer))
    return _with_closure_wrapped(optimizer, args, kwargs, len(_scopes()) - 1)


def _post_step(optimizer, args, kwargs):
    devices = _close_scope()
    if devices and _tiering.available():
        _evict(devices)


def _on_cuda(value) -> bool:
    return value.is_cuda


def _adopt_tensor(value):
    """A copy of the plain tensor `value`, made under the scope _adopt_loaded_state opened."""
    return value.clone()


def _flatten(value):
    """(inner tensor names, context) of a wrapper subclass that implements PyTorch's
    flatten protocol (__tensor_flatten__, as FSDP2's DTensor does); None for anything else."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    return value.__tensor_flatten__() if is_traceable_wrapper_subclass(value) else None


def _plain_parts(value) -> list:
    """The plain tensors holding `value`'s data: itself, or a wrapper's (_flatten) inner
    tensors, recursively. [] for anything else (nn.Parameter, other subclasses)."""
    torch = _install.STATE.torch
    if type(value) is torch.Tensor:
        return [value]
    flat = _flatten(value)
    if flat is None:
        return []
    return [part for name in flat[0] for part in _plain_parts(getattr(value, name))]


def _adopted(value):
    """`value` with every plain part copied by _adopt_tensor; a wrapper subclass is
    rebuilt around its copied parts. A DTensor keeps its own spec (mesh, placements,
    shard order: its __tensor_unflatten__ would rebuild the spec without the order);
    other wrappers are rebuilt by __tensor_unflatten__. A part that is neither a plain
    tensor nor a wrapper is kept as it is."""
    torch = _install.STATE.torch
    if type(value) is torch.Tensor:
        return _adopt_tensor(value)
    flat = _flatten(value)
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
               for part in _plain_parts(value))


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
    devices = _cuda_devices(optimizer)
    if not devices or not _tiering_or_warn():
        return 0
    min_bytes = (_install.STATE.config or {}).get("tier_min_bytes", 1 << 20)
    stray = [(state, key) for state in optimizer.state.values() for key, value in state.items()
             if _outside_tiering(value, min_bytes)]
    if not stray:
        return 0
    adopted = 0
    depth = len(_scopes())
    own = _devices_not_held(devices)
    _open_scope(own, _tags.OPTIMIZER_STATE)
    try:
        with _install.STATE.torch.no_grad():  # copies of state, not steps of a graph
            for state, key in stray:
                value = state[key]
                state[key] = _adopted(value)  # the old copy is freed as the last reference goes
                adopted += sum(part.numel() * part.element_size() for part in _plain_parts(value))
    finally:
        _close_scopes_down_to(depth)
    _evict(own)
    return adopted


def register(torch):
    """Registers the two global step hooks, wraps Optimizer.load_state_dict and torch's
    step patcher (Note [a step that raises]); returns what removes each (two hook
    handles and a Patches)."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    optimizer_class = torch.optim.Optimizer
    original_load = optimizer_class.load_state_dict
    original_patcher = optimizer_class.profile_hook_step

    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        _adopt_loaded_state(self)
        return result

    def profile_hook_step(func):
        return _guard_step(original_patcher(func))

    patches = _patches.Patches()
    patches.replace(optimizer_class, "load_state_dict", load_state_dict)
    patches.replace(optimizer_class, "profile_hook_step", staticmethod(profile_hook_step))
    return (register_optimizer_step_pre_hook(_pre_step),
            register_optimizer_step_post_hook(_post_step), patches)
