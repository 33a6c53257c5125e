"""Global torch.optim step hooks: the optimizer state any torch.optim optimizer creates
inside step() is tagged optimizer_state (see Note [step tags]); before each step it is prefetched, after each
step it is evicted to host memory (pointer-stable, so AdamW's foreach and fused paths
keep their tensors and notice nothing).

Whether the pre-hook prefetches depends on tidepool.state_budget, see Note [state budget 0].
The pre-hook opens a scope (tag push, and in pool mode the tidepool MemPool for each
device the optimizer's parameters live on); the post-hook closes it. torch runs no
post-hook when step() raises, so a scope left open is closed by the next pre-hook on
that thread rather than leaking into the rest of the program's allocations.
"""

from __future__ import annotations

import threading
import warnings

from . import _install, _tags, _tiering

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


def _pre_step(optimizer, args, kwargs):
    torch = _install.STATE.torch
    _close_scope()
    devices = _cuda_devices(optimizer)
    if devices and _tiering_or_warn() and _state_budget_allows_prefetch():
        for d in devices:
            _tiering.prefetch_tag(d, _tags.OPTIMIZER_STATE, _stream(torch, d))
    contexts = []
    pool = _install.pool()
    if pool is not None:
        for d in devices:
            context = torch.cuda.use_mem_pool(pool, d)
            context.__enter__()
            contexts.append(context)
    _tags.push(_step_tag(optimizer))
    _local.scope = (devices, contexts)


def _post_step(optimizer, args, kwargs):
    torch = _install.STATE.torch
    devices = _close_scope()
    if devices and _tiering.available():
        for d in devices:
            _tiering.evict_tag(d, _tags.OPTIMIZER_STATE, _stream(torch, d))


def register(torch):
    """Registers the two global hooks; returns their handles."""
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)

    return (register_optimizer_step_pre_hook(_pre_step),
            register_optimizer_step_post_hook(_post_step))
