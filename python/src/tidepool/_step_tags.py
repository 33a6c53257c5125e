"""Which tag an optimizer step runs under (Note [step tags]): optimizer_state when the
step may create state, so that the state lands in pointer-stable, evictable ranges;
workspace otherwise, so that the foreach/fused temporaries freed before step() returns
take no migratable ranges. The pre-hook asks _step_tag; the post-hook of an
optimizer_state step remembers the parameters left without state (_remember_stateless),
or an optimizer that keeps no state for some parameters would make every step an
optimizer_state one. This reads only the optimizer and its param groups, never the
scopes or the tiering layer (_optim_hooks.py runs the hooks).
"""

from __future__ import annotations

import weakref

from . import _tags

# Note [step tags]: optimizer -> {id(p): (weak reference to p, _settings of its group)} for
# the parameters a step went through and left without state. Weak both ways: it keeps
# neither the optimizer nor its parameters alive (an id is trusted only while its
# reference still gives that very parameter, so a parameter dropped and another made at
# its address is new).
_stateless: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


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
            if p.grad is not None and not has_state(state, p):
                entry = known.get(id(p)) if known else None
                if entry is None or entry[0]() is not p:
                    return _tags.OPTIMIZER_STATE
                if settings is None:
                    settings = _settings(group)
                if entry[1] != settings:
                    return _tags.OPTIMIZER_STATE
    return _tags.WORKSPACE


def has_state(state, p) -> bool:
    """Whether optimizer.state holds state for `p`: an entry that is not an empty dict
    (torch's optimizers keep a dict per parameter, which `state[p]` makes empty). A
    custom optimizer's entry may be a tensor itself: it is state, whatever its value
    (a tensor's truth value is its element's, or an error for several)."""
    entry = state.get(p)
    if entry is None:
        return False
    return len(entry) > 0 if isinstance(entry, (dict, list, tuple)) else True


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
            if p.grad is not None and not has_state(state, p):
                try:
                    known[id(p)] = (weakref.ref(p), settings)
                except TypeError:  # a parameter type without weak references: counts each time
                    pass


def _forget_stateless(optimizer) -> None:
    try:
        _stateless.pop(optimizer, None)
    except TypeError:
        pass
