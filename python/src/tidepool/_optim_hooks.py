"""Global torch.optim step hooks: the optimizer state any torch.optim optimizer creates
inside step() is tagged optimizer_state (see Note [step tags]); before each step it is prefetched, after each
step it is evicted to host memory (pointer-stable, so AdamW's foreach and fused paths
keep their tensors and notice nothing).

Whether the pre-hook prefetches depends on tidepool.state_budget, see Note [state budget 0].
The pre-hook opens a scope (tag push, and in pool mode the tidepool MemPool for each
device the optimizer's parameters live on); the post-hook closes it. torch runs no
post-hook when step() raises, so a scope left open is closed by the next pre-hook on
that thread rather than leaking into the rest of the program's allocations.

State that appears outside step() is taken in too: Optimizer.load_state_dict (resuming
from a checkpoint) is wrapped, see Note [loaded state].
"""

from __future__ import annotations

import threading
import warnings

from . import _install, _patches, _tags, _tiering

_local = threading.local()
_warned_no_tiering = False


def _cuda_devices(optimizer) -> list[int]:
    devices = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.is_cuda:
                devices.add(p.device.index)
    return sorted(devices)


def _step_tag(optimizer) -> int:
    """Note [step tags]: a step that creates state (a parameter with a gradient has none
    yet: the first step, or parameters added later) runs under optimizer_state, so the
    state lands in pointer-stable, evictable ranges. Later steps run under workspace:
    their allocations are the foreach/fused temporaries, freed before step() returns,
    and need no migratable (slower to create) ranges."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and not optimizer.state.get(p):
                return _tags.OPTIMIZER_STATE
    return _tags.WORKSPACE


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


def _close_scope() -> list[int]:
    scope = getattr(_local, "scope", None)
    if scope is None:
        return []
    _local.scope = None
    devices, pool_contexts = scope
    _tags.pop()
    for context in reversed(pool_contexts):
        context.__exit__(None, None, None)
    return devices


def _open_scope(devices: list[int], tag: int) -> None:
    """Allocations of this thread go under `tag` (and, in pool mode, to the tidepool
    MemPool of each device) until _close_scope."""
    torch = _install.STATE.torch
    contexts = []
    pool = _install.pool()
    if pool is not None:
        for d in devices:
            context = torch.cuda.use_mem_pool(pool, d)
            context.__enter__()
            contexts.append(context)
    _tags.push(tag)
    _local.scope = (devices, contexts)


def _evict(devices: list[int]) -> None:
    torch = _install.STATE.torch
    for d in devices:
        _tiering.evict_tag(d, _tags.OPTIMIZER_STATE, _stream(torch, d))


def _pre_step(optimizer, args, kwargs):
    torch = _install.STATE.torch
    _close_scope()
    devices = _cuda_devices(optimizer)
    if devices and _tiering_or_warn() and _state_budget_allows_prefetch():
        for d in devices:
            _tiering.prefetch_tag(d, _tags.OPTIMIZER_STATE, _stream(torch, d))
    _open_scope(devices, _step_tag(optimizer))


def _post_step(optimizer, args, kwargs):
    devices = _close_scope()
    if devices and _tiering.available():
        _evict(devices)


def _on_cuda(value) -> bool:
    return value.is_cuda


def _adopt_tensor(value):
    """A copy of `value` made under the scope _adopt_loaded_state opened."""
    return value.clone()


def _outside_tiering(value, min_bytes: int) -> bool:
    torch = _install.STATE.torch
    # Plain tensors only: a subclass (FSDP2's DTensor, ...) is not one storage to copy.
    return (type(value) is torch.Tensor and _on_cuda(value)
            and value.numel() * value.element_size() >= min_bytes
            and not _tiering.owns(value.device.index, value.data_ptr()))


def _adopt_loaded_state(optimizer) -> int:
    """Note [loaded state]: optimizer.load_state_dict (resuming from a checkpoint) creates
    the state outside step(), so no step scope tags it: state tensors moved to the device
    by the load (map_location="cpu"), or loaded onto it directly (map_location="cuda"),
    would be ordinary device memory, resident for the rest of the run: a model that only
    fits with its state off the device would run out of memory on resuming. So after the
    load every state tensor that tidepool would have made pointer-stable (on a CUDA
    device, at least tidepool.tier_min_bytes, not already in a tiered range) is copied
    into one under the optimizer_state tag, as a step would have made it, and the state
    is evicted as after a step. Tensor subclasses (FSDP2's DTensor state) are left as
    they are. Returns the bytes taken in."""
    devices = _cuda_devices(optimizer)
    if not devices or not _tiering_or_warn():
        return 0
    min_bytes = (_install.STATE.config or {}).get("tier_min_bytes", 1 << 20)
    stray = [(state, key) for state in optimizer.state.values() for key, value in state.items()
             if _outside_tiering(value, min_bytes)]
    if not stray:
        return 0
    adopted = 0
    _close_scope()
    _open_scope(devices, _tags.OPTIMIZER_STATE)
    try:
        for state, key in stray:
            value = state[key]
            state[key] = _adopt_tensor(value)  # the old copy is freed as the last reference goes
            adopted += value.numel() * value.element_size()
    finally:
        _close_scope()
    _evict(devices)
    return adopted


def register(torch):
    """Registers the two global step hooks and wraps Optimizer.load_state_dict; returns
    what removes each (two hook handles and a Patches)."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    original_load = torch.optim.Optimizer.load_state_dict

    def load_state_dict(self, state_dict):
        result = original_load(self, state_dict)
        _adopt_loaded_state(self)
        return result

    patches = _patches.Patches()
    patches.replace(torch.optim.Optimizer, "load_state_dict", load_state_dict)
    return (register_optimizer_step_pre_hook(_pre_step),
            register_optimizer_step_post_hook(_post_step), patches)
