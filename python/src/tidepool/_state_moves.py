"""Moves an optimizer's state around its step: before it, the stepped optimizer's state
comes to the device by pointer (Note [prefetch by pointer]), only with a state budget
(Note [state budget 0]); after it, the device's whole optimizer_state tag goes to host
memory (Note [evict by tag]), or only the step's own optimizers' state, by pointer,
while another thread's step on the device is in flight (Note [steps in flight] in
_in_flight.py). The step hooks (_optim_hooks.py) and the adoption of loaded state
(_loaded_state.py) move state only through here, so that a build without tiering warns
once (_tiering_or_warn) and every move runs on the device's current stream (_stream).
"""

from __future__ import annotations

import warnings

from . import _in_flight, _install, _state_outside, _state_tensors, _tags, _tiering

_warned_no_tiering = False


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
    outside optimizer.state] in _state_outside.py). Tiered stores (tidepool's C++
    optimizers') are not reached: their optimizers load their own handles. A step nested
    in another optimizer's (Lookahead stepping its inner optimizer) prefetches its own
    state even on a device the enclosing step holds: the enclosing step brought only its
    own. A step nested in the same optimizer's (a subclass's step() calling its base's,
    both hooked by torch) prefetches nothing: the enclosing one did (_being_stepped in
    _optim_hooks.py). In pool mode a step that overlaps another thread's step on a
    device prefetches nothing there (Note [steps in flight in pool mode] in
    _in_flight.py)."""
    torch = _install.STATE.torch
    by_device = _state_tensors._state_pointers(optimizer, every_parameter=has_closure)
    for d, remembered in _state_outside._known_outside_state(optimizer).items():
        by_device.setdefault(d, []).extend(_state_outside._still_held(d, remembered))
    if not _install.pool_mode():
        for d, ptrs in by_device.items():
            _tiering.prefetch_ptrs(d, ptrs, _stream(torch, d))
        return
    # Pool mode: only where no other thread's step is in flight (Note [steps in flight in
    # pool mode] in _in_flight.py).
    with _in_flight.prefetching_alone(list(by_device)) as alone:
        for d in alone:
            _tiering.prefetch_ptrs(d, by_device[d], _stream(torch, d))


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
                own = _state_tensors._pointers_of(optimizers)
                _state_outside._learn_outside_state(optimizers, by_tag, own)
            except Exception as e:  # only a prefetch hint is lost: the eviction goes on
                _state_outside._warn_learning_failed(e)
        for d in by_tag:
            _tiering.evict_tag(d, _tags.OPTIMIZER_STATE, _stream(torch, d))
        if by_pointer:
            if own is None:
                own = _state_tensors._pointers_of(optimizers)
            for d in by_pointer:
                if own.get(d):
                    _tiering.evict_ptrs(d, own[d], _stream(torch, d))
