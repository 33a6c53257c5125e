"""Takes in the optimizer state that Optimizer.load_state_dict creates outside step()
(Note [loaded state]): state on a CUDA device that no step scope tagged is copied into
pointer-stable optimizer_state ranges (Note [adopted state] in _adoption.py) and evicted
as after a step, so that resuming from a checkpoint does not leave it resident on the
device. The install wraps load_state_dict with this (register in _optim_hooks.py).
"""

from __future__ import annotations

import sys

from . import _adoption, _state_moves, _state_tensors, _step_scopes


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


def _adopt_loaded_state(optimizer) -> int:
    """Note [loaded state]: optimizer.load_state_dict (resuming from a checkpoint) creates
    the state outside step(), so no step scope tags it: state tensors moved to the device
    by the load (map_location="cpu"), or loaded onto it directly (map_location="cuda"),
    would be ordinary device memory, resident for the rest of the run: a model that only
    fits with its state off the device would run out of memory on resuming. So after the
    load every state tensor that tidepool would have made pointer-stable (on a CUDA
    device, at least tidepool.tier_min_bytes, not already in a tiered range; LBFGS's
    history lists included) is copied into one under the optimizer_state tag, as a step
    would have made it (Note [adopted state] in _adoption.py), and the state is evicted
    as after a step. Returns the bytes taken in.

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
        return 0
    stray = _adoption.stray_state(optimizers)
    if not stray:
        return 0
    own = _step_scopes._devices_not_held(devices)
    adopted = _adoption.adopt_stray_state(optimizers, own, stray, "on_load")
    _state_moves._evict(own, optimizers)
    return adopted
