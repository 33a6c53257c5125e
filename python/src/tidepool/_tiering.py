"""The tiering layer's C ABI (tiering/c_api_tiering.h), called by tag: move every
allocation under a tag to host memory (evict) or bring it back (prefetch, within
tidepool.state_budget), pointer-stable; and prefetch or evict by pointers, one call for
the ranges holding a list of tensors (one optimizer's state). Its errors land in
tidepool_last_error, as the allocator's do. A build without tiering says so instead of
pretending."""

from __future__ import annotations

import ctypes
import sys

from . import _lib


class TieringStatsV1(ctypes.Structure):
    """Mirror of tidepool_tiering_stats_v1; field for field, in order."""
    _fields_ = (
        [("struct_size", ctypes.c_uint32), ("version", ctypes.c_uint32),
         ("device", ctypes.c_int32), ("stores", ctypes.c_uint32),
         ("h2d_bytes", ctypes.c_uint64), ("d2h_bytes", ctypes.c_uint64)]
        + [(n, ctypes.c_double) for n in ("h2d_busy_ms", "d2h_busy_ms", "h2d_gb_per_s",
                                          "d2h_gb_per_s", "exposed_wait_ms", "hidden_ms")]
        + [(n, ctypes.c_uint64) for n in (
            "device_bytes", "device_budget_bytes", "acquires", "prefetch_issued", "prefetch_hits",
            "prefetch_late", "misses", "prefetch_skipped", "evictions", "evictions_clean",
            "reclaim_calls", "reclaimed_bytes", "pinned_host_bytes", "pageable_host_bytes",
            "pageable_fallbacks", "vmm_ranges", "vmm_device_bytes", "vmm_host_bytes",
            "vmm_bytes_to_host", "vmm_bytes_to_device", "vmm_failed_migrations")]
        + [("vmm_migration_ms", ctypes.c_double)]
        # appended after the first release of v1 (a shorter struct_size gets the prefix)
        + [(n, ctypes.c_uint64) for n in (
            "vmm_device_budget_bytes", "vmm_budget_stops", "vmm_bytes_left_on_host")]
        + [(n, ctypes.c_uint64) for n in ("off_schedule_acquires", "schedule_adoptions")]
        + [(n, ctypes.c_uint64) for n in (
            "shared_budget_stores", "shared_budget_charged_bytes", "peer_evictions",
            "peer_evicted_bytes", "peer_room_requests")]
        + [("loads_skipped", ctypes.c_uint64), ("vmm_spare_host_bytes", ctypes.c_uint64)]
        + [(n, ctypes.c_uint64) for n in (
            "pinned_budget_bytes", "process_pinned_bytes", "vmm_pinned_bytes",
            "vmm_pinned_budget_stops", "vmm_bytes_left_on_device")]
        + [(n, ctypes.c_uint64) for n in ("host_promotions", "host_promoted_bytes")])


_SIGNATURES = {
    "tidepool_evict_tag": (ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
    "tidepool_prefetch_tag_within_budget": (ctypes.c_int, [ctypes.c_int, ctypes.c_int,
                                                           ctypes.c_void_p,
                                                           ctypes.POINTER(ctypes.c_uint64)]),
    "tidepool_prefetch_ptrs": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                              ctypes.c_size_t, ctypes.c_void_p,
                                              ctypes.POINTER(ctypes.c_uint64)]),
    "tidepool_evict_ptrs": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                           ctypes.c_size_t]),
    "tidepool_device_ranges_except": (ctypes.c_int, [
        ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
        ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.POINTER(ctypes.c_size_t)]),
    "tidepool_get_tiering_stats_v1": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]),
    "tidepool_vmm_owns": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
    "tidepool_range_ids": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
                                          ctypes.c_size_t, ctypes.POINTER(ctypes.c_uint64)]),
    "tidepool_step_begin": (ctypes.c_int, [ctypes.c_int]),
    "tidepool_step_end": (ctypes.c_int, [ctypes.c_int]),
    "tidepool_steps_in_flight": (ctypes.c_int, [ctypes.c_int]),
}


def _fn(name: str):
    fn = _lib.function(name, "optimizer-state tiering")
    fn.restype, fn.argtypes = _SIGNATURES[name]
    return fn


def available() -> bool:
    return all(_lib.optional(n) is not None
               for n in ("tidepool_evict_tag", "tidepool_prefetch_tag_within_budget"))


def _check(status: int, what: str) -> None:
    _lib.check(status, what)


def _synchronize(device: int, stream: int | None) -> None:
    """Waits for everything enqueued so far on `stream` (None: nothing to wait for): the
    evictions take no stream, and a migration must not race kernels still using the
    memory."""
    if stream is not None:
        torch = sys.modules.get("torch")  # installed in, or (LD_PRELOAD shim) only imported
        if torch is None:
            raise RuntimeError("tidepool: evicting after a stream needs torch")
        torch.cuda.ExternalStream(stream, device=device).synchronize()


def note_step(device: int, begins: bool) -> None:
    """Tells the C side that a step begins or ends on `device` on this thread (Note [Steps
    of other threads] in tiering/steps_in_flight.cpp: an out-of-memory then leaves the
    state of other threads' steps where it is). Nothing with a build without tiering."""
    name = "tidepool_step_begin" if begins else "tidepool_step_end"
    if _lib.optional(name) is not None:
        _check(_fn(name)(device), f"{'beginning' if begins else 'ending'} a step on device "
                                  f"{device}")


def _raw_stats(device: int) -> TieringStatsV1 | None:
    """The device's tiering stats struct; None with a library built without tiering."""
    if _lib.optional("tidepool_get_tiering_stats_v1") is None:
        return None
    raw = TieringStatsV1()
    raw.struct_size = ctypes.sizeof(TieringStatsV1)
    _check(_fn("tidepool_get_tiering_stats_v1")(device, ctypes.byref(raw)),
           f"reading tiering stats of device {device}")
    return raw


def _stores_on(device: int) -> int:
    """The live tiered stores of the device."""
    raw = _raw_stats(device)
    return 0 if raw is None else raw.stores


def _pointer_array(ptrs: list[int]):
    return (ctypes.c_void_p * len(ptrs))(*ptrs)


def evict_tag(device: int, tag: int, stream: int | None = None) -> None:
    """Evicts after everything enqueued so far on `stream`. When none of the tag's ranges
    is on the device (state_budget:0, where new state is made on the host and never
    prefetched) and the device has no tiered store (whose handles the ranges' list does
    not name: tidepool.optim's tiered state), there is nothing to move and nothing to wait
    for: the wait, a host synchronisation, would stop the CPU queueing the next iteration
    ahead of the GPU at every step (once per parameter with an optimizer per parameter
    stepped in backward)."""
    try:
        on_device = bool(device_ranges_except(device, tag, [])) or _stores_on(device) > 0
    except RuntimeError:  # a bad device: the eviction below says so in its own words
        on_device = True
    if not on_device:
        return
    _synchronize(device, stream)
    _check(_fn("tidepool_evict_tag")(device, tag), f"evicting tag {tag} on device {device}")


def evict_ptrs(device: int, ptrs: list[int], stream: int | None = None) -> None:
    """Evicts the ranges holding `ptrs`, each once, after everything enqueued so far on
    `stream`; pointers in no range (0, ordinary device memory) are skipped, as by
    prefetch_ptrs. One C call however many pointers."""
    _synchronize(device, stream)
    _check(_fn("tidepool_evict_ptrs")(device, _pointer_array(ptrs), len(ptrs)),
           f"evicting {len(ptrs)} pointers on device {device}")


def prefetch_tag(device: int, tag: int, stream: int | None = None) -> int:
    """Brings the tag's allocations back to the device, oldest first, while they fit in
    tidepool.state_budget. Returns the bytes that stayed in host memory (still usable
    at the same addresses, over the link)."""
    left_on_host = ctypes.c_uint64(0)
    _check(_fn("tidepool_prefetch_tag_within_budget")(device, tag, stream,
                                                      ctypes.byref(left_on_host)),
           f"prefetching tag {tag} on device {device}")
    return left_on_host.value


def prefetch_ptrs(device: int, ptrs: list[int], stream: int | None = None) -> int:
    """Brings the ranges holding `ptrs` back to the device, in that order, each once, while
    they fit in tidepool.state_budget; pointers in no range (0, ordinary device memory)
    are skipped. One C call however many pointers (a ctypes call per tensor would cost
    more than the walk that finds them). Returns the bytes that stayed in host memory."""
    left_on_host = ctypes.c_uint64(0)
    _check(_fn("tidepool_prefetch_ptrs")(device, _pointer_array(ptrs), len(ptrs), stream,
                                         ctypes.byref(left_on_host)),
           f"prefetching {len(ptrs)} pointers on device {device}")
    return left_on_host.value


def device_ranges_except(device: int, tag: int, ptrs: list[int]) -> list[int]:
    """The base addresses of the device's ranges of `tag` that are on the device and hold
    none of `ptrs`, oldest first: what a step used beyond the state it names (Note [state
    outside optimizer.state] in _state_outside.py). One C call, two when there are more
    than 64 such ranges (a range made between the two calls is tried again)."""
    fn = _fn("tidepool_device_ranges_except")
    names = _pointer_array(ptrs)
    capacity = 64
    while True:
        out = (ctypes.c_void_p * capacity)()
        count = ctypes.c_size_t(0)
        _check(fn(device, tag, names, len(ptrs), out, capacity, ctypes.byref(count)),
               f"listing the ranges of tag {tag} on device {device}")
        if count.value <= capacity:
            return [out[i] for i in range(count.value)]
        capacity = count.value


def range_ids(device: int, ptrs: list[int]) -> list[int]:
    """For each pointer, the identity of the device's pointer-stable range holding it (0:
    none), never given to another range though an address may be: a range remembered by
    address is still the same one while its id is. One C call."""
    ids = (ctypes.c_uint64 * len(ptrs))()
    _check(_fn("tidepool_range_ids")(device, _pointer_array(ptrs), len(ptrs), ids),
           f"identifying the ranges of {len(ptrs)} pointers on device {device}")
    return list(ids)


def owns(device: int, ptr: int) -> bool:
    """Whether `ptr` lies in one of the device's pointer-stable (evictable) ranges."""
    return _fn("tidepool_vmm_owns")(ptr, device) == 1


def transfer_stats(device: int) -> dict:
    """'transfer.*' and 'tiering.*' keys for tidepool.stats(); {} without tiering."""
    raw = _raw_stats(device)
    if raw is None:
        return {}
    out = {}
    for name, _ in TieringStatsV1._fields_[4:]:
        prefix = "transfer" if name.startswith(("h2d", "d2h", "exposed", "hidden")) else "tiering"
        out[f"{prefix}.{name}"] = getattr(raw, name)
    return out
