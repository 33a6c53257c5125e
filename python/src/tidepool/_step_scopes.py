"""A thread's step scopes: from an optimizer step's pre-hook to its post-hook the thread's
allocations go under the step's tag (and, in pool mode, for a step that may create
state, to tidepool's MemPool of each device the step holds), and the step counts as in
flight on those devices (Note [steps in flight] in _in_flight.py). Scopes nest (a
subclass's step() calling its base's, Lookahead stepping its inner optimizer), a nested
step holding only the devices no enclosing scope holds (_devices_not_held). A scope also
closes without its post-hook: around a closure (Note [closures] in _optim_hooks.py) and
when a step raises (Note [a step that raises] in _optim_hooks.py). So opening and closing
are kept here, with the thread-local stack of scopes they share, and closing goes on
through errors: nothing may stay entered.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

from . import _in_flight, _install, _tags

_local = threading.local()


class _Scope(NamedTuple):
    """An open step scope (_open_scope)."""
    devices: list[int]   # the devices whose state the step evicts (_devices_not_held)
    contexts: list       # the MemPool contexts it entered (pool mode)
    tag: int             # the tag it pushed
    stepping: int | None  # id() of the optimizer whose step opened it; None for a load
    optimizers: list     # its optimizer, then those stepped inside it (Note [steps in flight])
    pooled: list[int]    # the devices it routes to tidepool's MemPools under optimizer_state
    # The frame of torch's hooked step() that opened it (None for a scope that is not a
    # step's): the scope is a step's still running while that frame is on the thread's
    # stack (Note [a scope no running step owns] in _optim_hooks.py).
    frame: object = None


def _scopes() -> list[_Scope]:
    """This thread's open step scopes, innermost last."""
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


def _close_scope(step_over: bool = True) -> _Scope | None:
    """Closes the innermost scope and returns it (None when none is open). Unless
    `step_over` (the closure of a step that goes on, Note [closures] in _optim_hooks.py),
    its step is counted out of its devices (Note [steps in flight])."""
    scopes = _scopes()
    if not scopes:
        return None
    scope = scopes.pop()
    try:
        try:
            _tags.pop()
        finally:
            _install.exit_all(scope.contexts)
    finally:
        if step_over:
            _in_flight.end(scope.devices)
    return scope


def _close_scopes_down_to(depth: int, errors: list | None = None) -> list[_Scope]:
    """Closes scopes until `depth` are left; returns those it closed. A scope whose closing
    raised is closed all the same (_close_scope); the error is raised after the others
    are closed, or appended to `errors` when that is given (unless it is no Exception:
    a KeyboardInterrupt is raised)."""
    closed, first_error = [], None
    while len(_scopes()) > depth:
        scope = _scopes()[-1]
        try:
            _close_scope()
        except BaseException as e:  # noqa: BLE001  (raised or handed over below)
            first_error = first_error or e
        closed.append(scope)
    if first_error is not None:
        if errors is None or not isinstance(first_error, Exception):
            raise first_error
        errors.append(first_error)
    return closed


def _devices_not_held(devices: list[int]) -> list[int]:
    """Those of `devices` no open scope holds: a nested step (a subclass's step() calling
    its base's, both wrapped by torch with the hooks, or one optimizer stepping another)
    evicts state and enters pools only for those, since evicting the tag covers all of a
    device's state and the enclosing step still runs after the nested one. (Its
    prefetch is its own optimizer's state, on every device: Note [prefetch by pointer]
    in _state_moves.py.)"""
    held = {d for scope in _scopes() for d in scope.devices}
    return [d for d in devices if d not in held]


def _open_scope(own: list[int], tag: int, stepping=None, optimizers: list | None = None,
                pooled: list[int] | None = None, frame=None) -> None:
    """Allocations of this thread go under `tag` (and, in pool mode, when `tag` is
    optimizer_state, to the tidepool MemPool of each device in `pooled`, by default
    `own`: Note [only state steps enter the pool]) until _close_scope, which counts the
    step out of `own` (from _devices_not_held): the caller counted it in
    (_in_flight.begin), and counts it out itself if this raises. `optimizers`: whose
    state the scope's step uses (by default the one `stepping`).

    Note [only state steps enter the pool]: in pool mode a step whose allocations are
    only temporaries (a workspace step, Note [step tags] in _step_tags.py) allocates as
    the program does outside it, with PyTorch's own allocator. In tidepool's MemPool those
    temporaries would be served from the blocks PyTorch's pool keeps cached: blocks of
    the state's segments, and the freed temporaries of the step that made the state
    (tagged optimizer_state, so made migratable), all of which the post-hook's eviction
    by tag moves to host memory with the state. Temporaries placed there would make
    every later step read and write them over the link.

    A state step nested in another step (Lookahead stepping its inner optimizer for the
    first time) holds no device the enclosing step holds (_devices_not_held), but its
    state is made on them all the same: so its pools are those of every device of its
    own (`pooled`: the step's devices), not only of those it holds. An enclosing state
    step routes the device already, and the nested lease only counts (Note [one MemPool
    per thread and device at a time] in _install.py); an enclosing workspace step
    entered no pool, and without its own the nested step's state would be made in
    PyTorch's memory, taken into tiering only by a copy after the enclosing step (Note
    [state made in workspace steps] in _stray_state.py), and PyTorch's cache would keep
    the device memory it was first made in."""
    if pooled is None:
        pooled = own
    contexts = []
    try:
        if _install.pool_mode() and tag == _tags.OPTIMIZER_STATE:
            for d in pooled:  # Note [one MemPool per thread and device at a time] in _install.py
                context = _install.pool_lease(d, tag)
                context.__enter__()
                contexts.append(context)
        _tags.push(tag)
    except BaseException:
        _install.exit_all(contexts)  # nothing stays entered (another thread may need the pools)
        raise
    if optimizers is None:
        optimizers = [] if stepping is None else [stepping]
    _scopes().append(_Scope(own, contexts, tag, None if stepping is None else id(stepping),
                            optimizers, pooled, frame))


def _begun(own: list[int], begin_scope) -> None:
    """Counts a step in on `own` (Note [steps in flight]) and calls `begin_scope`, which
    opens its scope; counts it out again when that raises before the scope is open."""
    _in_flight.begin(own)
    try:
        begin_scope()
    except BaseException:
        _in_flight.end(own)
        raise
