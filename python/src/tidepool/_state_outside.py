"""The state an optimizer keeps outside optimizer.state (Note [state outside
optimizer.state]): after a step, the ranges of optimizer_state on the device that hold
none of the optimizer's state tensors are learnt, by base address and range id, so that
the next step's prefetch (Note [prefetch by pointer] in _state_moves.py) brings them in
after its own state. Only a hint: when learning fails, a warning says so once and only
the prefetch of that state is lost.
"""

from __future__ import annotations

import warnings
import weakref

from . import _install, _tags, _tiering

_warned_learning_failed = False  # _warn_learning_failed says it once per process
# Note [state outside optimizer.state]: optimizer -> {device: {base address: range id}} of
# the ranges of state it keeps elsewhere, in allocation order, learnt after each of its
# steps.
_outside_state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
    Only with a state budget (no prefetch otherwise: Note [state budget 0] in
    _state_moves.py). Other optimizers' state is not on the device then: each step
    evicts its tag, and a device another thread's step is in flight on is not asked
    about (its state is there). Only in global mode: in pool mode a range is a segment
    of PyTorch's allocator, which keeps the segments freed allocations leave (the
    temporaries of the step that made the state) and later puts any allocation of the
    pool there, another optimizer's state among them, which the prefetch would then
    bring in with this optimizer's (Note [prefetch by pointer] in _state_moves.py); a
    step's tensors outside optimizer.state are used where they are there.

    A range is remembered by its base address and its id (_tiering.range_ids), which no
    later range is given: a range freed between two steps may have its address taken by
    another optimizer's state, which the prefetch would otherwise bring to the device for
    nothing, after which this learning would find it there and keep it, at every step.
    So the prefetch names only the bases whose range is still the one learnt
    (_still_held), and a base kept from the last time stays only while its id does.
    `own` is the pointers of the optimizers' state (_pointers_of in _state_tensors.py),
    by device."""
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
