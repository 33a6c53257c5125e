"""Takes in the optimizer state that Optimizer.load_state_dict creates outside step()
(Note [loaded state]): torch's load runs under the optimizer_state tag, so the copies it
makes on the parameters' devices are made in tiering; state it left elsewhere on a CUDA
device is copied into pointer-stable optimizer_state ranges (Note [adopted state] in
_adoption.py); and the state is evicted as after a step, so that resuming from a
checkpoint does not leave it resident on the device. The install wraps load_state_dict
with this (register in _optim_hooks.py).
"""

from __future__ import annotations

import sys

from . import (_adoption, _state_moves, _state_tensors, _step_scopes, _step_tags,
               _stray_state, _tags)


def loaded_optimizers(optimizer) -> list:
    """The optimizers whose state a load_state_dict of `optimizer` may have replaced: the
    optimizer, and ZeroRedundancyOptimizer's local optimizer (Note [loaded state])."""
    module = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    zero = getattr(module, "ZeroRedundancyOptimizer", None)
    if zero is None or not isinstance(optimizer, zero):
        return [optimizer]
    local = getattr(optimizer, "optim", None)
    if local is None or local is optimizer or not hasattr(local, "state") \
            or not hasattr(local, "param_groups"):
        return [optimizer]
    return [optimizer, local]


def load(optimizer, torch_load):
    """Note [loaded state]: optimizer.load_state_dict (resuming from a checkpoint) creates
    the state outside step(), so no step scope tags it. torch's load (`torch_load`, which
    returns its result) copies each state tensor to its parameter's device (from a
    checkpoint loaded with map_location="cpu"): run under the optimizer_state tag, as a
    step that makes state is, those copies are made in tiering (pointer-stable ranges; in
    pool mode, in tidepool's MemPool), not as ordinary device memory holding the whole
    state at once (review finding: a run whose state fits only off the device ran out of
    memory resuming from its own checkpoint). Every state tensor left elsewhere on a CUDA
    device (loaded onto it directly, map_location="cuda", which the load keeps as it is)
    that tidepool would have made pointer-stable (at least tidepool.tier_min_bytes, not
    in a tiered range; LBFGS's history lists included) is then copied into one under the
    optimizer_state tag (Note [adopted state] in _adoption.py), and the state is evicted
    as after a step. A copy that fails (its memory ran out) is said, not raised, as after
    a step: the load is done, and each place the copies did not reach keeps the tensor
    the load put there. Returns what torch's load returned.

    torch.distributed.optim.ZeroRedundancyOptimizer keeps two: its load_state_dict puts
    this rank's state into its local optimizer (`optim`, whose steps use it) itself,
    copied to the parameters' devices, before it calls Optimizer.load_state_dict, which
    loads a second copy into its own `state` (which no step reads). Both are taken in
    (loaded_optimizers): the local state is the one to tier, and the other, left
    resident, would take as much device memory (the adoption keeps whatever the two
    copies share shared)."""
    optimizers = loaded_optimizers(optimizer)
    devices = sorted({d for o in optimizers for d in _state_tensors._cuda_devices(o)})
    if not devices or not _state_moves._tiering_or_warn():
        result = torch_load()
        _forget_stateless(optimizers)
        return result
    own = _step_scopes._devices_not_held(devices)
    depth = len(_step_scopes._scopes())
    _step_scopes._begun(own, lambda: _step_scopes._open_scope(
        own, _tags.OPTIMIZER_STATE, optimizers=list(optimizers), pooled=devices))
    try:
        result = torch_load()
    finally:
        _step_scopes._close_scopes_down_to(depth)
    _forget_stateless(optimizers)
    try:
        stray = _adoption.stray_state(optimizers)
        if stray:
            _adoption.adopt_stray_state(optimizers, own, stray, "on_load")
    except Exception as error:  # noqa: BLE001  (the load is done; said, as after a step)
        _stray_state._warn_once("failed", optimizer,
                                f"loaded optimizer state could not be copied into tiering, "
                                f"and what was not copied stays in device memory: {error}")
    finally:
        _state_moves._evict(own, optimizers)
    return result


def _forget_stateless(optimizers) -> None:
    for loaded in optimizers:
        _step_tags._forget_stateless(loaded)  # Note [step tags]: loaded groups may make state
