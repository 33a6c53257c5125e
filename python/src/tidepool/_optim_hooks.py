"""Global torch.optim step hooks: the optimizer state any torch.optim optimizer creates
inside step() is tagged optimizer_state (see Note [step tags]); before each step the state
of the optimizer being stepped is prefetched (Note [prefetch by pointer]), after each
step the device's optimizer_state is evicted to host memory (Note [evict by tag];
pointer-stable, so AdamW's foreach and fused paths keep their tensors and notice nothing),
or only the stepped optimizer's while another thread's step on the device still runs
(Note [steps in flight] in _in_flight.py; in pool mode nothing, Note [steps in flight in
pool mode]).

Whether the pre-hook prefetches depends on tidepool.state_budget, see Note [state budget 0].
The pre-hook opens a scope (tag push, and in pool mode a tidepool MemPool for each device
the optimizer's parameters live on, _install.pool_lease); the post-hook closes it. See
Note [a step that raises] for what closes it when step() raises, and Note [closures] for
the closure of step(closure), which runs outside it.

State that appears outside step() is taken in too: Optimizer.load_state_dict (resuming
from a checkpoint) is wrapped, see Note [loaded state].
"""

from __future__ import annotations

import functools
import sys
import threading
import warnings
import weakref
from typing import NamedTuple

from . import _in_flight, _install, _patches, _tags, _tiering

_local = threading.local()
_warned_no_tiering = False
_warned_learning_failed = False
# Note [step tags]: optimizer -> {id(p): (weak reference to p, _settings of its group)} for
# the parameters a step went through and left without state. Weak both ways: it keeps
# neither the optimizer nor its parameters alive (an id is trusted only while its
# reference still gives that very parameter, so a parameter dropped and another made at
# its address is new).
_stateless: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Note [state outside optimizer.state]: optimizer -> {device: {base address: range id}} of
# the ranges of state it keeps elsewhere, in allocation order, learnt after each of its
# steps.
_outside_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cuda_devices(optimizer) -> list[int]:
    devices = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.is_cuda:
                devices.add(p.device.index)
    return sorted(devices)


def _step_tag(optimizer) -> int:
    """Note [step tags]: a step that may create state runs under optimizer_state, so the
    state lands in pointer-stable, evictable ranges. That is a step in which a parameter
    with a gradient has no state yet and has not been through a step before (the first
    step, a parameter added later by add_param_group, one whose state was cleared: by
    optimizer.state.clear(), a new optimizer.state, or load_state_dict). Other steps run
    under workspace: their allocations are the foreach/fused temporaries, freed before
    step() returns, which need no migratable (slower to create) ranges and would only be
    evicted for nothing.

    A parameter the optimizer leaves without state (SGD without momentum; any parameter
    an optimizer does not keep state for) would otherwise make every step an
    optimizer_state one; so the post-hook of an optimizer_state step remembers, per
    optimizer, the parameters that had a gradient and still have no state
    (_remember_stateless, in _stateless), and they do not count again while their
    group's hyperparameters stay as they were then. A change that may turn state on
    (momentum raised by hand from 0, a scheduler cycling it up from 0) makes the
    remembered parameters of that group count again, so the state the next step creates
    is tagged optimizer_state; without that it would be made under workspace, in
    ordinary device memory, resident for the rest of the run. What is compared is
    _settings: a scheduler changing lr every step changes nothing there.
    load_state_dict forgets them all (the loaded param_groups may turn momentum on)."""
    state = optimizer.state
    known = _known_stateless(optimizer)
    for group in optimizer.param_groups:
        settings = None  # the group's, computed once a remembered parameter needs them
        for p in group["params"]:
            if p.grad is not None and not state.get(p):
                entry = known.get(id(p)) if known else None
                if entry is None or entry[0]() is not p:
                    return _tags.OPTIMIZER_STATE
                if settings is None:
                    settings = _settings(group)
                if entry[1] != settings:
                    return _tags.OPTIMIZER_STATE
    return _tags.WORKSPACE


def _settings(group: dict) -> tuple:
    """Note [step tags]: what of a param group's hyperparameters (its entries but
    'params') may decide whether the optimizer keeps state, as (key, _setting) pairs."""
    return tuple((key, _setting(value)) for key, value in group.items() if key != "params")


def _setting(value):
    """A number (a bool too): whether it is not 0, as optimizers decide on state (SGD's
    and RMSprop's momentum, a beta); its other changes (lr, scheduled every step) make no
    state. A str or None: itself; a tuple or list (betas): that of each item; anything
    else (a tensor lr): ..., never compared."""
    if isinstance(value, (int, float)):
        return value != 0
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (tuple, list)):
        return tuple(_setting(item) for item in value)
    return ...


def _known_stateless(optimizer) -> dict | None:
    """The optimizer's remembered stateless parameters (Note [step tags]); None when there
    are none, or the optimizer cannot be weakly referenced (a class with __slots__
    without __weakref__: nothing is remembered for it, every step that finds a stateless
    parameter runs under optimizer_state, as before)."""
    try:
        return _stateless.get(optimizer)
    except TypeError:
        return None


def _remember_stateless(optimizer) -> None:
    """After an optimizer_state step: remembers the parameters it went through (they had
    a gradient) and left without state (Note [step tags])."""
    state = optimizer.state
    try:
        known = _stateless.setdefault(optimizer, {})
    except TypeError:  # not weakly referenceable: see _known_stateless
        return
    for group in optimizer.param_groups:
        settings = _settings(group)
        for p in group["params"]:
            if p.grad is not None and not state.get(p):
                try:
                    known[id(p)] = (weakref.ref(p), settings)
                except TypeError:  # a parameter type without weak references: counts each time
                    pass


def _forget_stateless(optimizer) -> None:
    try:
        _stateless.pop(optimizer, None)
    except TypeError:
        pass


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


def _cuda_index(tensor) -> int:
    """The index of the CUDA device `tensor` is on; -1 when it is on none."""
    return tensor.get_device() if tensor.is_cuda else -1


def _add_pointers(value, by_device: dict) -> None:
    """Appends to by_device[d] the data pointer of each plain tensor (_plain_parts: a
    DTensor's local shard) in `value` on CUDA device d; `value` may be a tensor, or a
    dict, list or tuple of them (LBFGS keeps lists of tensors), nested."""
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        for part in _plain_parts(value):
            d = _cuda_index(part)
            if d >= 0:
                by_device.setdefault(d, []).append(part.data_ptr())
        return
    for item in value:
        _add_pointers(item, by_device)


def _state_pointers(optimizer, every_parameter: bool) -> dict[int, list[int]]:
    """Note [prefetch by pointer]: device -> the data pointers of the optimizer's state
    tensors on it, parameter by parameter in param_groups order (the order its step
    uses them), then the state under keys that are no parameter of a group. Unless
    `every_parameter`, only the state of parameters with a gradient."""
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


def _prefetch_state(optimizer, has_closure: bool) -> None:
    """Note [prefetch by pointer]: before a step, with a state budget, the ranges holding
    this optimizer's state come back to the device, as far as the budget allows, in the
    order the step uses them: one C call per device (tidepool_prefetch_ptrs), whatever
    the number of tensors. The state of a parameter without a gradient is left out: the
    step skips that parameter (a frozen layer, an expert no token was routed to), and
    its state would take budget and link time from state the step uses. With a closure
    everything is named: its backward makes the gradients after the prefetch.

    Only the optimizer being stepped: with several (a GAN's generator and discriminator,
    stepped one after the other) a prefetch of the whole optimizer_state tag would also
    bring in the others' state, spending link bandwidth and device budget on state this
    step does not touch, which the post-hook then evicts again.

    The pointers are data pointers of the plain tensors in optimizer.state (a DTensor's
    local shard); the C side moves the range holding each, once: views and tensors
    sharing a storage name a range again (or point inside it: the pool finds the range
    holding any address in it), and are skipped. Pointers in no range (state under
    tidepool.tier_min_bytes, in ordinary device memory and always resident; an empty
    tensor's 0) are skipped there too, so nothing is asked per tensor from Python.

    State the optimizer keeps outside optimizer.state (a tensor on the optimizer object
    or in a param group, made during an optimizer_state step) comes after it, in
    allocation order, from what the post-hook learnt after the last step (Note [state
    outside optimizer.state]). Tiered stores (tidepool's C++ optimizers') are not reached:
    their optimizers load their own handles. A step nested in another optimizer's
    (Lookahead stepping its inner optimizer) prefetches its own state even on a device
    the enclosing step holds: the enclosing step brought only its own. A step nested in
    the same optimizer's (a subclass's step() calling its base's, both hooked by torch)
    prefetches nothing: the enclosing one did (_being_stepped). In pool mode a step that
    overlaps another thread's step on a device prefetches nothing there (Note [steps in
    flight in pool mode] in _in_flight.py)."""
    torch = _install.STATE.torch
    by_device = _state_pointers(optimizer, every_parameter=has_closure)
    for d, remembered in _known_outside_state(optimizer).items():
        by_device.setdefault(d, []).extend(_still_held(d, remembered))
    if not _install.pool_mode():
        for d, ptrs in by_device.items():
            _tiering.prefetch_ptrs(d, ptrs, _stream(torch, d))
        return
    # Pool mode: only where no other thread's step is in flight (Note [steps in flight in
    # pool mode] in _in_flight.py).
    with _in_flight.prefetching_alone(list(by_device)) as alone:
        for d in alone:
            _tiering.prefetch_ptrs(d, by_device[d], _stream(torch, d))


def _known_outside_state(optimizer) -> dict[int, dict[int, int]]:
    try:
        return _outside_state.get(optimizer, {})
    except TypeError:  # not weakly referenceable: nothing is remembered for it
        return {}


def _still_held(device: int, remembered: dict[int, int]) -> list[int]:
    """The remembered bases whose address the range learnt still holds (one C call): a
    range freed since, its address taken by another optimizer's state, is not brought
    back (Note [state outside optimizer.state])."""
    bases = list(remembered)
    ids = _tiering.range_ids(device, bases) if bases else []
    return [b for b, i in zip(bases, ids) if i == remembered[b]]


def _learn_outside_state(optimizers: list, devices: list[int],
                         own: dict[int, list[int]]) -> None:
    """Note [state outside optimizer.state]: after a step of optimizers[0] (with those
    stepped inside it), before the eviction by tag, on `devices` where no other step is in
    flight: the ranges of optimizer_state on the device that hold none of their state in
    optimizer.state are state the step keeps elsewhere (a tensor on the optimizer object,
    in a param group, in a closure's cell), made or prefetched for this step; the next
    step prefetches them after its own state, so a budget that has room for them spares
    the step reading them over the link. Each step learns them anew: state no longer
    kept is freed (its range gone) or no longer on the device. Those the budget left on
    the host are kept from the last time while their range is alive (else a budget
    too small for them would forget them after one step), so the prefetch tries again.
    Only with a state budget (no prefetch otherwise: Note [state budget 0]). Other
    optimizers' state is not on the device then: each step evicts its tag, and a device
    another thread's step is in flight on is not asked about (its state is there). Only
    in global mode: in pool mode a range is a segment of PyTorch's allocator, which keeps
    the segments freed allocations leave (the temporaries of the step that made the
    state) and later puts any allocation of the pool there, another optimizer's state
    among them, which the prefetch would then bring in with this optimizer's (Note
    [prefetch by pointer]); a step's tensors outside optimizer.state are used where they
    are there.

    A range is remembered by its base address and its id (_tiering.range_ids), which no
    later range is given: a range freed between two steps may have its address taken by
    another optimizer's state, which the prefetch would otherwise bring to the device for
    nothing, after which this learning would find it there and keep it, at every step.
    So the prefetch names only the bases whose range is still the one learnt
    (_still_held), and a base kept from the last time stays only while its id does.
    `own` is the pointers of the optimizers' state (_pointers_of), by device."""
    optimizer = optimizers[0]
    known = _known_outside_state(optimizer)
    learnt: dict[int, dict[int, int]] = {}
    for d in devices:
        remembered = known.get(d, {})
        bases = _tiering.device_ranges_except(d, _tags.OPTIMIZER_STATE, own.get(d, []))
        on_device = set(bases)
        asked = bases + [b for b in remembered if b not in on_device]
        ids = _tiering.range_ids(d, asked) if asked else []
        kept = {b: i for b, i in zip(asked, ids)
                if i != 0 and (b in on_device or i == remembered[b])}
        if kept:
            learnt[d] = kept
    for d, bases in known.items():  # devices not asked this time keep theirs
        if d not in devices:
            learnt[d] = bases
    try:
        if learnt:
            _outside_state[optimizer] = learnt
        else:
            _outside_state.pop(optimizer, None)
    except TypeError:
        pass


def _warn_learning_failed(error: Exception) -> None:
    global _warned_learning_failed
    if not _warned_learning_failed and (_install.STATE.config or {}).get("log") != "off":
        warnings.warn(f"tidepool: could not learn the state kept outside optimizer.state "
                      f"({error}); it is not prefetched before the next steps (said once)",
                      RuntimeWarning)
        _warned_learning_failed = True


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


class _Scope(NamedTuple):
    """An open step scope (_open_scope)."""
    devices: list[int]   # the devices whose state the step evicts (_devices_not_held)
    contexts: list       # the MemPool contexts it entered (pool mode)
    tag: int             # the tag it pushed
    stepping: int | None  # id() of the optimizer whose step opened it; None for a load
    optimizers: list     # its optimizer, then those stepped inside it (Note [steps in flight])


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
    `step_over` (the closure of a step that goes on, Note [closures]), its step is
    counted out of its devices (Note [steps in flight])."""
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
    prefetch is its own optimizer's state, on every device: Note [prefetch by pointer].)"""
    held = {d for scope in _scopes() for d in scope.devices}
    return [d for d in devices if d not in held]


def _open_scope(own: list[int], tag: int, stepping=None, optimizers: list | None = None) -> None:
    """Allocations of this thread go under `tag` (and, in pool mode, to the tidepool
    MemPool of each device in `own`, from _devices_not_held) until _close_scope, which
    counts the step out of `own`: the caller counted it in (_in_flight.begin), and counts
    it out itself if this raises. `optimizers`: whose state the scope's step uses (by
    default the one `stepping`)."""
    contexts = []
    try:
        if _install.pool_mode():
            for d in own:  # Note [one MemPool per thread and device at a time] in _install.py
                context = _install.pool_lease(d)
                context.__enter__()
                contexts.append(context)
        _tags.push(tag)
    except BaseException:
        _install.exit_all(contexts)  # nothing stays entered (another thread may need the pools)
        raise
    if optimizers is None:
        optimizers = [] if stepping is None else [stepping]
    _scopes().append(_Scope(own, contexts, tag, None if stepping is None else id(stepping),
                            optimizers))


def _begun(own: list[int], begin_scope) -> None:
    """Counts a step in on `own` (Note [steps in flight]) and calls `begin_scope`, which
    opens its scope; counts it out again when that raises before the scope is open."""
    _in_flight.begin(own)
    try:
        begin_scope()
    except BaseException:
        _in_flight.end(own)
        raise


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

    Scopes nest: each guarded step's pre-hook keeps the scopes below the depth at which
    its step began (an enclosing step's, guarded or not) and closes any above it (left
    by an unguarded step that raised: one wrapped by hand, past torch's patcher). Such
    a step's own pre-hook keeps the scopes of the guarded steps running around it and
    closes the rest, so a scope it left when it raised is closed by the next step on the
    thread."""

    @functools.wraps(hooked_step)
    def guarded_step(*args, **kwargs):
        steps = _guarded_steps()
        base = len(_scopes())
        steps.append(base)
        try:
            return hooked_step(*args, **kwargs)
        except BaseException:
            errors = []  # the step's own error is the one to raise
            closed = _close_scopes_down_to(base, errors)
            devices = sorted({d for scope in closed for d in scope.devices})
            if devices and _tiering.available():
                try:
                    _evict(devices, [o for scope in closed for o in scope.optimizers])
                except Exception as evict_error:  # noqa: BLE001
                    errors.append(evict_error)
            for error in errors:
                warnings.warn(f"tidepool: closing the scope of a step that raised, or evicting "
                              f"its optimizer state, failed: {error}",
                              _install.TidepoolInactiveWarning)
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


def _evict(devices: list[int], optimizers: list) -> None:
    """Note [evict by tag]: after a step, all of each device's optimizer_state goes to
    host memory, not only the stepped optimizer's. By tag it also takes what the
    pre-hook's prefetch by pointer cannot name: state kept outside optimizer.state, and
    the state of optimizers stepped inside this one (Lookahead's inner optimizer); and it
    costs one C call per device, with no walk over the state in Python. On a device
    where another thread's step is still in flight, only `optimizers`' state goes (the
    step's own optimizer's and those stepped inside it), by pointer: the tag would take
    the other step's state from under it (Note [steps in flight] in _in_flight.py).

    The other optimizers' state in the tag was evicted after their own steps, and costs
    next to nothing again: the tiering layer goes through the tag's ranges and returns
    for each one already in host memory before waiting for the streams that used it
    (Note [Nothing to move, nothing to wait for] in tiering/vmm_migration.cpp; without
    that it would record and synchronize an event per stream, per range), and skips a
    tiered store's handles that are not on the device. What remains per call is the
    stream synchronization of _tiering.evict_tag (needed anyway: the step's kernels must
    be done before its state moves) and a walk over the tag's range list in C++."""
    torch = _install.STATE.torch
    with _in_flight.evicting(devices) as (by_tag, by_pointer):
        if _install.pool_mode():
            # The state's segments may hold the other step's state too: the last step to end
            # evicts the tag (Note [steps in flight in pool mode] in _in_flight.py).
            by_pointer = []
        own = None  # the optimizers' state pointers: one walk serves learning and eviction
        if by_tag and optimizers and _state_budget_allows_prefetch() and not _install.pool_mode():
            try:
                own = _pointers_of(optimizers)
                _learn_outside_state(optimizers, by_tag, own)
            except Exception as e:  # only a prefetch hint is lost: the eviction goes on
                _warn_learning_failed(e)
        for d in by_tag:
            _tiering.evict_tag(d, _tags.OPTIMIZER_STATE, _stream(torch, d))
        if by_pointer:
            if own is None:
                own = _pointers_of(optimizers)
            for d in by_pointer:
                if own.get(d):
                    _tiering.evict_ptrs(d, own[d], _stream(torch, d))


def _pointers_of(optimizers: list) -> dict[int, list[int]]:
    """device -> the pointers of the optimizers' state tensors (_state_pointers, every
    parameter's), one optimizer after the other."""
    by_device: dict[int, list[int]] = {}
    for optimizer in optimizers:
        for d, ptrs in _state_pointers(optimizer, every_parameter=True).items():
            by_device.setdefault(d, []).extend(ptrs)
    return by_device


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
        scope = _close_scope(step_over=False)  # the step stays in flight (Note [steps in flight])
        try:
            return closure(*args, **kwargs)
        finally:
            try:
                _open_scope(scope.devices, _step_tag(optimizer), optimizer, scope.optimizers)
            except BaseException:
                _in_flight.end(scope.devices)
                raise

    return closure_outside_the_scope


def _closure_index(args, kwargs) -> int | str | None:
    """Where step()'s closure is: 1 (args[1]: torch hands the hooks step()'s arguments
    with the optimizer first), "closure" (a keyword), or None when there is none."""
    if len(args) > 1 and callable(args[1]):
        return 1
    if callable(kwargs.get("closure")):
        return "closure"
    return None


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
    return any(scope.stepping == id(optimizer) for scope in _scopes())


def _pre_step(optimizer, args, kwargs):
    _close_scopes_down_to(_scopes_to_keep())
    devices = _cuda_devices(optimizer)
    own = _devices_not_held(devices)

    def prefetch_and_open():  # counted in first: Note [steps in flight]
        if devices and _tiering_or_warn() and _state_budget_allows_prefetch() \
                and not _being_stepped(optimizer):
            _prefetch_state(optimizer, _closure_index(args, kwargs) is not None)
        _open_scope(own, _step_tag(optimizer), optimizer)

    _begun(own, prefetch_and_open)
    scopes = _scopes()
    for scope in scopes[:-1]:  # the enclosing steps evict this one's state too
        if not any(o is optimizer for o in scope.optimizers):
            scope.optimizers.append(optimizer)
    return _with_closure_wrapped(optimizer, args, kwargs, len(scopes) - 1)


def _post_step(optimizer, args, kwargs):
    scopes = _scopes()
    if scopes and scopes[-1].tag == _tags.OPTIMIZER_STATE:  # the tag the step ended under
        _remember_stateless(optimizer)
    scope = _close_scope()
    if scope is not None and scope.devices and _tiering.available():
        _evict(scope.devices, scope.optimizers)


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


def _plain_parts(value, any_tensor: bool = False) -> list:
    """The plain tensors holding `value`'s data: itself, or a wrapper's (_flatten) inner
    tensors, recursively. [] for anything else (nn.Parameter, other subclasses), unless
    `any_tensor`: then a tensor of any other subclass is its own part (a user's
    nn.Parameter handed to tidepool.evict). (Also reached by tidepool.evict(), where
    tidepool may be installed in no torch: under the LD_PRELOAD shim.)"""
    torch = _install.STATE.torch or sys.modules["torch"]
    if type(value) is torch.Tensor:
        return [value]
    flat = _flatten(value)
    if flat is None:
        return [value] if any_tensor and isinstance(value, torch.Tensor) else []
    return [part for name in flat[0] for part in _plain_parts(getattr(value, name), any_tensor)]


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
    _begun(own, lambda: _open_scope(own, _tags.OPTIMIZER_STATE, optimizers=[optimizer]))
    try:
        with _install.STATE.torch.no_grad():  # copies of state, not steps of a graph
            for state, key in stray:
                value = state[key]
                state[key] = _adopted(value)  # the old copy is freed as the last reference goes
                adopted += sum(part.numel() * part.element_size() for part in _plain_parts(value))
    finally:
        _close_scopes_down_to(depth)
    _evict(own, [optimizer])
    return adopted


def _subclasses(base) -> list:
    """Every class derived from `base`, however deep, each once."""
    found, stack = [], [base]
    while stack:
        for cls in type.__subclasses__(stack.pop()):
            if cls not in found:
                found.append(cls)
                stack.append(cls)
    return found


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
        _forget_stateless(self)  # Note [step tags]: the loaded groups may make state now
        _adopt_loaded_state(self)
        return result

    def profile_hook_step(func):
        return _guard_step(original_patcher(func))

    patches = _patches.Patches()
    patches.replace(optimizer_class, "load_state_dict", load_state_dict)
    patches.replace(optimizer_class, "profile_hook_step", staticmethod(profile_hook_step))
    # The classes torch wrapped already get the guard now (Note [a step that raises]).
    for cls in _subclasses(optimizer_class):
        step = vars(cls).get("step")
        if getattr(step, "hooked", False) and not getattr(step, "tidepool_guarded", False):
            patches.replace(cls, "step", _guard_step(step))  # keeps torch's `hooked` mark
    return (register_optimizer_step_pre_hook(_pre_step),
            register_optimizer_step_post_hook(_post_step), patches)
