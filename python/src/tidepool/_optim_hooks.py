"""Global torch.optim step hooks: the optimizer state any torch.optim optimizer creates
inside step() is tagged optimizer_state (see Note [step tags] in _step_tags.py); before
each step the state of the optimizer being stepped is prefetched (Note [prefetch by
pointer] in _state_moves.py), after each step the device's optimizer_state is evicted
to host memory (Note [evict by tag] in _state_moves.py; pointer-stable, so AdamW's
foreach and fused paths keep their tensors and notice nothing), or only the stepped
optimizer's while another thread's step on the device still runs (Note [steps in
flight] in _in_flight.py; in pool mode nothing, Note [steps in flight in pool mode]).

Whether the pre-hook prefetches depends on tidepool.state_budget, see Note [state budget
0] in _state_moves.py. The pre-hook opens a scope (tag push, and in pool mode, for a step
that may create state, a tidepool MemPool for each device the optimizer's parameters live
on, _install.pool_lease; see _step_scopes.py); the post-hook closes it. See Note [a step
that raises] for what closes it when step() raises, and Note [closures] for the closure
of step(closure), which runs outside it.

State made in a step that ran under workspace (LBFGS's) is taken into tiering after the
step, before the eviction: Note [state made in workspace steps] in _stray_state.py. State
that appears outside step() is taken in too: Optimizer.load_state_dict (resuming from a
checkpoint) is wrapped, see Note [loaded state] in _loaded_state.py. Optimizers that keep
their state themselves (tidepool.optim's Apollo), and steps captured in a CUDA graph
(Note [a step captured in a CUDA graph] in _captured_steps.py), are left alone. The
published AADL's history, which no hook sees, is pointed out once (_untiered_history.py).

This module installs the hooks and runs them; what they decide and move is in the
modules named above, which import nothing from here.
"""

from __future__ import annotations

import functools
import inspect
import sys
import weakref

from . import (_captured_steps, _in_flight, _install, _loaded_state, _patches, _state_moves,
               _state_tensors, _step_scopes, _step_tags, _stray_state, _tags, _tiering,
               _untiered_history)


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

    An optimizer class whose step() torch wrapped before tidepool was installed (an
    optimizer made before tidepool.install(), or while the hooks were off) gets the
    guard at the install (register: its step() is replaced, and put back on removal).
    An LR scheduler made before the install wrapped its optimizer's step() on the
    instance (torch's patch_track_step_called), around the function the class had then,
    which calling optimizer.step() reaches past the class's guarded one; so the install
    also points each such wrapper at the guarded function (_guard_scheduled_steps).
    Without that a step that raised there would leave its scope open, and every guarded
    step after it would keep that scope as an enclosing one (below), holding its
    devices: their state would no longer be evicted.

    Scopes nest: each guarded step's pre-hook keeps the scopes below the depth at which
    its step began (an enclosing step's, guarded or not) and closes any above it (left
    by an unguarded step that raised: one wrapped by hand, past torch's patcher, or
    reached through a reference taken before a late install). Every pre-hook also closes
    the scopes whose steps are no longer running, and evicts their state (Note [a scope
    no running step owns], _scopes_to_keep), so a scope an unguarded step left when it
    raised is closed by the next step on the thread, guarded or not."""

    @functools.wraps(hooked_step)
    def guarded_step(*args, **kwargs):
        steps = _step_scopes._guarded_steps()
        base = len(_step_scopes._scopes())
        steps.append(base)
        try:
            return hooked_step(*args, **kwargs)
        except BaseException:
            errors = []  # the step's own error is the one to raise
            _evict_closed(_step_scopes._close_scopes_down_to(base, errors), errors)
            for error in errors:
                _install.warn_beside_error(f"tidepool: closing the scope of a step that raised, "
                                           f"or evicting its optimizer state, failed: {error}")
            raise
        finally:
            steps.pop()

    guarded_step.tidepool_guarded = True
    return guarded_step


def _evict_closed(closed: list, errors: list) -> None:
    """Evicts the state on the devices of the step scopes `closed` (closed without their
    post-hooks), as the post-hooks would have; a failure goes to `errors`."""
    devices = sorted({d for scope in closed for d in scope.devices})
    if devices and _tiering.available():
        try:
            _state_moves._evict(devices, [o for scope in closed for o in scope.optimizers])
        except Exception as evict_error:  # noqa: BLE001
            errors.append(evict_error)


def _scopes_to_keep() -> int:
    """How many open scopes belong to steps still running around this pre-hook's step
    (see _guard_step); the ones above are left by a step that raised unguarded. The
    innermost guarded step's own pre-hook finds exactly its base open (its scope is not
    yet); a step nested inside it finds that scope too, and keeps it.

    Note [a scope no running step owns]: a step reached past the guard (a bound method or
    a framework's wrapper of step() taken before a late tidepool.install(), a step wrapped
    by hand) that raised left its scope open, below any guarded step that began after it,
    which kept it as an enclosing step's: its tag stayed on, its step in flight, and its
    devices were never evicted again (review finding). So a scope also counts as running
    only while the frame of torch's hooked step() that opened it is on this thread's
    stack; the first one whose frame is not, and every scope above it, are left over."""
    scopes = _step_scopes._scopes()
    steps = _step_scopes._guarded_steps()
    keep = min(len(scopes), steps[-1] + 1) if steps else len(scopes)
    if keep == 0:  # the common case: no step around this one
        return 0
    running = set()
    frame = sys._getframe(1)
    while frame is not None:
        running.add(id(frame))
        frame = frame.f_back
    for index in range(keep):
        owner = scopes[index].frame
        if owner is not None and id(owner) not in running:
            return index
    return keep


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
    the state stays where the pre-hook put it.

    When the scope cannot open again (a pool lease refused, now that the tag is
    optimizer_state), that error goes on through the step, whose guard then finds no
    scope of the step to close, and so would evict nothing: the state prefetched for
    the step, and any the step made before the closure, would stay on the device. So the
    step is counted out and its state evicted here, as the guard would have
    (_scope_not_reopened)."""

    @functools.wraps(closure)
    def closure_outside_the_scope(*args, **kwargs):
        scopes = _step_scopes._scopes()
        if len(scopes) != index + 1:  # not the step's own scope on top: run it as it is
            return closure(*args, **kwargs)
        # the step stays in flight (Note [steps in flight])
        scope = scopes[-1]
        try:
            _step_scopes._close_scope(step_over=False)
            # Its state is not used while the closure runs (on the C side it is then no
            # step in flight: Note [Steps of other threads] in tiering/steps_in_flight.cpp).
            _in_flight.note_in_c(scope.devices, begins=False)
        except BaseException:
            # Closed all the same (closing goes on through errors), but the step is no
            # longer anyone's to count out: the guard finds no scope of it. Counted out,
            # and its state evicted, here, as when the scope does not open again.
            _scope_not_reopened(scope)
            raise
        try:
            return closure(*args, **kwargs)
        finally:
            try:
                _in_flight.note_in_c(scope.devices, begins=True)
                _step_scopes._open_scope(scope.devices, _step_tags._step_tag(optimizer), optimizer,
                                         scope.optimizers, scope.pooled, scope.frame)
            except BaseException:
                _scope_not_reopened(scope)
                raise

    return closure_outside_the_scope


def _scope_not_reopened(scope) -> None:
    """Note [closures]: the step whose scope did not open again after its closure is over
    on its devices; its state is evicted there, as after a step that raised. A failed
    eviction is said: the error that stopped the scope is the one to raise."""
    _in_flight.end(scope.devices)
    if scope.devices and _tiering.available():
        try:
            _state_moves._evict(scope.devices, scope.optimizers)
        except Exception as evict_error:  # noqa: BLE001
            _install.warn_beside_error(f"tidepool: evicting the state of a step whose scope did "
                                       f"not open again after its closure failed: {evict_error}")


def _closure_index(args, kwargs) -> int | str | None:
    """Where step()'s closure is: 1 (args[1]: torch hands the hooks step()'s arguments
    with the optimizer first), "closure" (a keyword), or None when there is none."""
    if len(args) > 1 and callable(args[1]) and _closure_comes_first(type(args[0])):
        return 1
    if callable(kwargs.get("closure")):
        return "closure"
    return None


# Optimizer class -> whether its step's first argument is the closure (_closure_comes_first).
_closure_first: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _closure_comes_first(optimizer_class) -> bool:
    """Whether the first argument of the class's step() (after self) is its closure, as
    in torch.optim's step(self, closure=None); a step whose signature cannot be read is
    taken to be one. Review finding: a custom step(self, model) was handed a wrapper for
    its callable nn.Module, as if it were the closure."""
    try:
        return _closure_first[optimizer_class]
    except KeyError:
        pass
    try:  # through functools.wraps: torch's hooked step, the guard
        params = list(inspect.signature(optimizer_class.step).parameters.values())
    except (AttributeError, TypeError, ValueError):
        params = []
    first = params[1] if len(params) > 1 else None
    closure = first is None or first.name == "closure" or first.kind is first.VAR_POSITIONAL
    _closure_first[optimizer_class] = closure
    return closure


def _with_closure_wrapped(optimizer, args, kwargs, index: int):
    """(args, kwargs) with step()'s closure (positional or keyword) wrapped by
    _closure_outside_the_scope; None when there is no closure."""
    where = _closure_index(args, kwargs)
    if where == 1:
        wrapped = _closure_outside_the_scope(optimizer, args[1], index)
        return ((args[0], wrapped, *args[2:]), kwargs)
    if where == "closure":
        return (args, {**kwargs,
                       "closure": _closure_outside_the_scope(optimizer, kwargs["closure"], index)})
    return None


def _being_stepped(optimizer) -> bool:
    """Whether an enclosing step on this thread is this optimizer's (a subclass's step()
    calling its base's: torch runs the hooks for both): its state was prefetched then."""
    return any(scope.stepping == id(optimizer) for scope in _step_scopes._scopes())


def _owns_state(optimizer) -> bool:
    """An optimizer that keeps its state itself, not in `optimizer.state`
    (tidepool.optim's Apollo: its placement moves it): the hooks leave its steps alone."""
    return getattr(optimizer, "_tidepool_owns_state", False)


def _pre_step(optimizer, args, kwargs):
    if _owns_state(optimizer):
        return None
    devices = _state_tensors._cuda_devices(optimizer)
    if _captured_steps.captured(optimizer, devices):  # Note [a step captured in a CUDA graph]
        return None
    _untiered_history.check(optimizer)
    # Scopes no running step owns (Note [a scope no running step owns]): closed, and their
    # state evicted as their steps' post-hooks would have.
    errors = []
    _evict_closed(_step_scopes._close_scopes_down_to(_scopes_to_keep()), errors)
    for error in errors:
        _install.warn_beside_error(f"tidepool: evicting the optimizer state of a step that "
                                   f"raised without its scope closed failed: {error}")
    own = _step_scopes._devices_not_held(devices)
    _stray_state.step_begins(optimizer, devices)

    prefetched = []

    frame = sys._getframe(1)  # torch's hooked step(): Note [a scope no running step owns]

    def prefetch_and_open():  # counted in first: Note [steps in flight]
        if devices and _state_moves._tiering_or_warn() \
                and _state_moves._state_budget_allows_prefetch() and not _being_stepped(optimizer):
            _state_moves._prefetch_state(optimizer, _closure_index(args, kwargs) is not None)
            prefetched.append(optimizer)
        _step_scopes._open_scope(own, _step_tags._step_tag(optimizer), optimizer, pooled=devices,
                                 frame=frame)

    try:
        _step_scopes._begun(own, prefetch_and_open)
    except BaseException:
        # The scope did not open (a pool lease refused), so the guard finds none to close
        # and evicts nothing: the state prefetched for the step goes back here.
        if prefetched and own:
            try:
                _state_moves._evict(own, prefetched)
            except Exception as evict_error:  # noqa: BLE001  (the step's error is the one)
                _install.warn_beside_error(f"tidepool: evicting the state prefetched for a step "
                                           f"whose scope did not open failed: {evict_error}")
        raise
    scopes = _step_scopes._scopes()
    for scope in scopes[:-1]:  # the enclosing steps evict this one's state too
        if not any(o is optimizer for o in scope.optimizers):
            scope.optimizers.append(optimizer)
    return _with_closure_wrapped(optimizer, args, kwargs, len(scopes) - 1)


def _post_step(optimizer, args, kwargs):
    if _owns_state(optimizer) or _captured_steps.captured(
            optimizer, _state_tensors._cuda_devices(optimizer)):
        return
    scopes = _step_scopes._scopes()
    if scopes and scopes[-1].tag == _tags.OPTIMIZER_STATE:  # the tag the step ended under
        _step_tags._remember_stateless(optimizer)
    if scopes:
        _stray_state.step_ended(optimizer, scopes[-1].tag)
    scope = _step_scopes._close_scope()
    if scope is not None and scope.devices and _tiering.available():
        try:
            _stray_state.adopt_after_step(scope.optimizers, scope.devices)
        finally:  # what was made stays usable where it is; the rest is evicted all the same
            _state_moves._evict(scope.devices, scope.optimizers)


def _subclasses(base) -> list:
    """Every class derived from `base`, however deep, each once."""
    found, stack = [], [base]
    while stack:
        for cls in type.__subclasses__(stack.pop()):
            if cls not in found:
                found.append(cls)
                stack.append(cls)
    return found


def _guard_scheduled_steps(guarded: dict, patches) -> None:
    """Note [a step that raises]: points the LR schedulers' instance wrappers of
    optimizer.step made before the install (functions marked _wrapped_by_lr_sched, whose
    closure holds the step() the class had) at the guarded steps; `guarded`: id(torch's
    hooked step) -> (that step, its guarded version). They are found among all of the
    interpreter's objects: only an install that finds steps torch wrapped already
    (tidepool.install() after optimizers were made) looks, once."""
    import gc
    import types

    for obj in gc.get_objects():
        if type(obj) is not types.FunctionType or not obj.__closure__ \
                or not getattr(obj, "_wrapped_by_lr_sched", False):
            continue
        for cell in obj.__closure__:
            try:
                contents = cell.cell_contents
            except ValueError:  # a variable not bound yet
                continue
            entry = guarded.get(id(contents))
            if entry is not None and entry[0] is contents:
                patches.replace_in_cell(cell, entry[1])


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
        return _loaded_state.load(self, lambda: original_load(self, state_dict))

    def profile_hook_step(func):
        return _guard_step(original_patcher(func))

    patches = _patches.Patches()
    patches.replace(optimizer_class, "load_state_dict", load_state_dict)
    patches.replace(optimizer_class, "profile_hook_step", staticmethod(profile_hook_step))
    # The classes torch wrapped already get the guard now, and so do the LR schedulers'
    # wrappers of their steps (Note [a step that raises]).
    guarded = {}
    for cls in _subclasses(optimizer_class):
        step = vars(cls).get("step")
        if getattr(step, "hooked", False) and not getattr(step, "tidepool_guarded", False):
            guarded[id(step)] = (step, _guard_step(step))
            patches.replace(cls, "step", guarded[id(step)][1])  # keeps torch's `hooked` mark
    if guarded:
        _guard_scheduled_steps(guarded, patches)
    return (register_optimizer_step_pre_hook(_pre_step),
            register_optimizer_step_post_hook(_post_step), patches)
