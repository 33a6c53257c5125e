"""State a step made outside an optimizer_state scope, taken into tiering after the step
(Note [state made in workspace steps]); which optimizers' state is looked through after
their steps, and which are trusted to make none, is decided here. The step post-hook
(_optim_hooks.py) calls adopt_after_step before it evicts.
"""

from __future__ import annotations

import warnings
import weakref

from . import _adoption, _install, _stats, _step_tags, _tags

_warned: set = set()  # (what, optimizer class) _warn_once has warned about

# Looks after vouching steps that find nothing before an optimizer is trusted to make no
# state outside optimizer_state steps.
_CLEAN_LOOKS_TO_TRUST = 2
# A trusted optimizer is looked through again _FIRST_RELOOK steps after it was trusted,
# then after twice as many steps each time, up to every _LAST_RELOOK steps.
_FIRST_RELOOK = 8
_LAST_RELOOK = 1024


class _Record:
    """Note [state made in workspace steps]: what is known of an optimizer. `clean`: looks
    after steps that vouch (step_ended) that found none of its state outside tiering since
    one last found some; `vouches`: whether its last step vouches; `next_look` and `gap`,
    once it is trusted: steps until its next look, and between the last two;
    `workspace_before`: once it is trusted, in global mode, the bytes alive under
    workspace on each of its devices when its current step began (Note [workspace
    growth]), else None."""

    __slots__ = ("clean", "vouches", "next_look", "gap", "workspace_before")

    def __init__(self):
        self.clean, self.vouches, self.next_look, self.gap = 0, False, 0, 0
        self.workspace_before = None


_records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizer -> _Record


def _record(optimizer) -> _Record:
    """The optimizer's record; a fresh one, never trusted, for an optimizer that cannot be
    weakly referenced (looked through after every step)."""
    try:
        record = _records.get(optimizer)
        if record is None:
            record = _records[optimizer] = _Record()
        return record
    except TypeError:
        return _Record()


def _workspace_bytes(device: int) -> int | None:
    """The bytes alive under the workspace tag on `device` (tidepool's per-tag stats);
    None when they cannot be read."""
    try:
        return _stats.raw_stats(device).tags[_tags.WORKSPACE].bytes.current
    except Exception:  # noqa: BLE001  (no stats: no trigger, the re-looks remain)
        return None


def step_begins(optimizer, devices: list[int]) -> None:
    """Called by every step's pre-hook with the optimizer's CUDA devices. Note [workspace
    growth]: a trusted optimizer is not looked through after each step, so state it
    starts making anew under workspace later (a restart that replaces its buffers every
    few thousand steps, a buffer cast to another dtype) would stay in device memory
    until the next re-look, up to _LAST_RELOOK steps on. In global mode every allocation
    goes through tidepool and is counted under its tag, and a workspace step's
    temporaries are freed before it returns; so bytes alive under workspace after the
    step that were not before it are most likely such state, and adopt_after_step looks
    at once. Another thread's allocations under workspace in the meantime make only a
    look that finds nothing. (In pool mode a workspace step allocates outside tidepool:
    nothing to read, the re-looks remain.) Costs one read of the stats per device and
    step, for trusted optimizers only."""
    record = _record(optimizer)
    record.workspace_before = None
    if record.clean < _CLEAN_LOOKS_TO_TRUST or not devices or not _install.STATE.active \
            or _install.pool_mode():
        return
    record.workspace_before = {d: _workspace_bytes(d) for d in devices}


def _workspace_grew(record: _Record) -> bool:
    """Note [workspace growth]: whether more bytes are alive under workspace on one of
    the devices than when the optimizer's step began (forgets the count)."""
    before, record.workspace_before = record.workspace_before, None
    if not before:
        return False
    for device, then in before.items():
        now = _workspace_bytes(device) if then is not None else None
        if now is not None and now > then:
            return True
    return False


def step_ended(optimizer, tag: int) -> None:
    """Called by every step's post-hook, nested steps' too, with the tag the step ended
    under (Note [state made in workspace steps]): notes whether a clean look after this
    step would vouch for the optimizer. It does when the step ran under workspace (state
    an optimizer_state step makes lands in ranges however it is made, so a clean look
    after one shows nothing) and some parameter whose state tiering takes in (a tensor
    of tidepool.tier_min_bytes or more) had a gradient: a step that updated no state, or
    only state too small to be tiered, shows nothing either (an optimizer that makes its
    state anew each step, stepped twice with gradients for its small parameters only,
    would otherwise be trusted and its large state made next left out). Not for a
    trusted optimizer."""
    record = _record(optimizer)
    if record.clean >= _CLEAN_LOOKS_TO_TRUST:
        return
    if tag != _tags.WORKSPACE:
        record.vouches = False
        return
    state, min_bytes = optimizer.state, _adoption.tier_min_bytes()
    record.vouches = any(
        p.grad is not None and _step_tags.has_state(state, p)
        and _adoption.holds_tierable(state[p], min_bytes)
        for group in optimizer.param_groups for p in group["params"])


def adopt_after_step(optimizers: list, own: list[int]) -> int:
    """Note [state made in workspace steps]: a step whose tag was workspace (Note [step
    tags] in _step_tags.py: no parameter was without state) may still make state: LBFGS
    keeps its one entry from the first step on and puts new tensors in it every step
    (the direction, the last gradient, two history vectors appended to lists); an
    optimizer written as `state["m"] = beta * state["m"] + g` makes its state anew each
    step. Made under workspace, that state is ordinary device memory, resident for the
    rest of the run, and it replaces the tiered tensors of the first step. So after a
    step, before its eviction, the state of the step's optimizers is looked through and
    what is outside tiering is copied into optimizer_state ranges (Note [adopted state]
    in _adoption.py), which the eviction then moves to host memory. The copy costs a
    device-to-device pass over the new state, small beside moving it over the link.

    Looking costs a walk over the state in Python, which a step that updates its state
    in place (every torch.optim optimizer but LBFGS) need not pay every step: an
    optimizer whose looks find nothing after _CLEAN_LOOKS_TO_TRUST steps in a row that
    vouch for it (step_ended: steps that ran under workspace and updated some state) is
    trusted and not looked through after every step; a look that finds state outside
    tiering starts the count again (so an optimizer that makes state every step, LBFGS,
    is looked through after every step, and one whose state was made once outside a
    step, as Adagrad's __init__ makes it, is trusted two steps after it was taken in).
    A trusted optimizer is looked through again now and then:
    _FIRST_RELOOK steps after it was trusted, then after twice as many steps each time,
    up to every _LAST_RELOOK steps; so state it starts making under workspace later (a
    custom optimizer that replaces its state only after some number of steps), or that
    code outside step() puts in its state, is taken in by the next such look, which
    starts the count again. In global mode a step after which more bytes are alive
    under workspace than before it is looked through at once (Note [workspace growth],
    step_begins). State something outside
    optimizer.state holds too stays where it is (Note [adopted state] in _adoption.py),
    with a warning once per optimizer class. A copy that fails (the memory for it ran
    out) is said the same way and does not fail the step, which is done: each place the
    copies did not reach keeps its tensor, and the next look tries again. Returns the
    bytes taken in."""
    adopted = 0
    for optimizer in optimizers:
        record = _record(optimizer)
        if record.clean >= _CLEAN_LOOKS_TO_TRUST and not _relook_due(record) \
                and not _workspace_grew(record):
            continue
        stray = _adoption.stray_state([optimizer], exclusive=True)
        shared = sum(stray.copier.shared_bytes.values())
        if shared:
            _warn_once("shared", optimizer,
                       f"{shared} bytes of its optimizer state, made in a step outside "
                       f"tidepool's optimizer_state tag, stay in device memory: something "
                       f"outside optimizer.state holds the same tensors or storages, and a "
                       f"copy in host memory would part them")
        if stray or shared:
            record.clean = 0
            try:
                adopted += _adoption.adopt_stray_state([optimizer], own, stray, "after_step")
            except Exception as error:  # noqa: BLE001  (the step is done; said, not raised)
                _warn_once("failed", optimizer,
                           f"optimizer state made in a step outside tidepool's "
                           f"optimizer_state tag could not be copied into tiering, and what "
                           f"was not copied stays in device memory: {error}")
        elif record.clean < _CLEAN_LOOKS_TO_TRUST and record.vouches:
            record.clean += 1
            if record.clean == _CLEAN_LOOKS_TO_TRUST:
                _start_relooks(record)
    return adopted


def _start_relooks(record: _Record) -> None:
    record.next_look = record.gap = _FIRST_RELOOK


def _relook_due(record: _Record) -> bool:
    """Counts a step of a trusted optimizer; whether it is the one to look again after
    (Note [state made in workspace steps])."""
    record.next_look -= 1
    if record.next_look > 0:
        return False
    record.gap = min(2 * record.gap, _LAST_RELOOK)
    record.next_look = record.gap
    return True


def _warn_once(what: str, optimizer, message: str) -> None:
    """Says `message` about `optimizer` once per optimizer class and kind of trouble
    (Note [state made in workspace steps]): state left in device memory because something
    else holds it too ("shared", Note [adopted state] in _adoption.py), or because
    copying it failed ("failed": the step is done, so the error is said, not raised; each
    place the copy did not reach keeps its tensor, whole)."""
    name = type(optimizer).__qualname__
    if (what, name) in _warned or (_install.STATE.config or {}).get("log") == "off":
        return
    _warned.add((what, name))
    warnings.warn(f"tidepool: {name}: {message}", _install.TidepoolInactiveWarning)
