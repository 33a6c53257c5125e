"""Takes in the optimizer state that Optimizer.load_state_dict creates outside step()
(Note [loaded state]): state on a CUDA device that no step scope tagged is copied into
pointer-stable optimizer_state ranges (Note [adopted state] in _adoption.py) and evicted
as after a step, so that resuming from a checkpoint does not leave it resident on the
device. The install wraps load_state_dict with this (register in _optim_hooks.py).
"""

from __future__ import annotations

from . import _adoption, _state_moves, _state_tensors, _step_scopes


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
    as after a step. Returns the bytes taken in."""
    devices = _state_tensors._cuda_devices(optimizer)
    if not devices or not _state_moves._tiering_or_warn():
        return 0
    stray = _adoption.stray_state([optimizer])
    if not stray:
        return 0
    own = _step_scopes._devices_not_held(devices)
    adopted = _adoption.adopt_stray_state([optimizer], own, stray, "on_load")
    _state_moves._evict(own, [optimizer])
    return adopted
