"""torch.cuda's memory statistics and empty_cache, answered by tidepool in global mode.

PyTorch's CUDAPluggableAllocator raises for getDeviceStats and resetPeakStats ("does not
yet support") and does nothing for emptyCache unless C++ hooks are set, which its Python
class cannot do. So under `tidepool.mode:global` a training script that logs
torch.cuda.max_memory_allocated() would stop with a RuntimeError, and
torch.cuda.empty_cache() would keep every cached byte. The package replaces, in
torch.cuda.memory and in torch.cuda:

  memory_stats_as_nested_dict   what memory_stats(), memory_allocated(),
                                max_memory_allocated(), memory_reserved(),
                                max_memory_reserved() and memory_summary() read: the
                                figures of tidepool's caching allocator in PyTorch's keys;
  reset_peak_memory_stats       tidepool_reset_peak_stats;
  reset_accumulated_memory_stats
                                the running totals these figures show ("allocated",
                                "freed", num_ooms, num_device_alloc, ...) count from the
                                call on; tidepool's own totals (tidepool.stats()) are kept
                                since start, as the C ABI documents them;
  empty_cache                   PyTorch's, then tidepool_empty_cache_all;
  set_per_process_memory_fraction
                                PyTorch's (its checks, and the C++ hook where
                                libtidepool_torch_cuda.so is c10's allocator), then
                                tidepool_set_memory_fraction, which torch's
                                CUDAPluggableAllocator class would not reach: the cap binds
                                all of tidepool's memory on the device, optimizer state in
                                pointer-stable ranges included;
  get_per_process_memory_fraction
                                tidepool_get_memory_fraction (torch's pluggable class raises).

What the keys mean here: "all" is tidepool's caching allocator; tidepool keeps one pool
per stream and does not split small from large blocks, so "large_pool" repeats "all"
and "small_pool" is zero. Optimizer state in pointer-stable ranges (tidepool.tier_min_bytes
and up) is not in these figures: it is reported by tidepool.stats() ("tiering.vmm_*"),
since it moves between device and host memory.
"""

from __future__ import annotations

from . import _lib, _patches, _stats

def _totals(raw) -> dict:
    """The running totals in tidepool's stats that reset_accumulated_memory_stats zeroes
    in PyTorch's figures, by name."""
    totals = {}
    for name in ("allocated", "requested", "reserved"):
        stat = getattr(raw, name)
        totals[name + ".allocated"] = stat.allocated
        totals[name + ".freed"] = stat.freed
    for name in ("alloc_count", "free_count", "segments_acquired", "segments_released",
                 "reclaim_calls", "oom_count"):
        totals[name] = getattr(raw, name)
    return totals


def _count(current: int, allocated: int, freed: int) -> dict:
    # tidepool keeps no peak of counts; the current value is the best lower bound.
    return {"current": current, "peak": current, "allocated": allocated, "freed": freed}


def _pools(all_pools: dict) -> dict:
    zero = dict.fromkeys(all_pools, 0)
    return {"all": all_pools, "large_pool": dict(all_pools), "small_pool": zero}


def nested_stats(device: int, since: dict | None = None) -> dict:
    """torch.cuda.memory_stats_as_nested_dict(device) from tidepool's stats; `since`, the
    _totals() taken at the last reset_accumulated_memory_stats, is subtracted from the
    running totals."""
    raw = _stats.raw_stats(device)
    base = since or {}
    total = {name: value - base.get(name, 0) for name, value in _totals(raw).items()}

    def stat(name):
        current = getattr(raw, name)
        return {"current": current.current, "peak": current.peak,
                "allocated": total[name + ".allocated"], "freed": total[name + ".freed"]}

    allocations = _count(raw.alloc_count - raw.free_count, total["alloc_count"],
                         total["free_count"])
    segments = _count(raw.segments_acquired - raw.segments_released,
                      total["segments_acquired"], total["segments_released"])
    return {
        "allocated_bytes": _pools(stat("allocated")),
        # A block is active from its allocation to its free (tidepool holds pending blocks
        # back without counting them as allocated).
        "active_bytes": _pools(stat("allocated")),
        "requested_bytes": _pools(stat("requested")),
        "reserved_bytes": _pools(stat("reserved")),
        # Split-off free blocks coalesce and can always be released with their range.
        "inactive_split_bytes": _pools(_count(0, 0, 0)),
        "allocation": _pools(allocations),
        "active": _pools(dict(allocations)),
        "segment": _pools(segments),
        "inactive_split": _pools(_count(0, 0, 0)),
        "num_alloc_retries": total["reclaim_calls"],
        "num_ooms": total["oom_count"],
        "num_device_alloc": total["segments_acquired"],
        "num_device_free": total["segments_released"],
        "num_sync_all_streams": 0,
        "oversize_allocations": _count(0, 0, 0),
        "oversize_segments": _count(0, 0, 0),
        "max_split_size": -1,  # PyTorch's "no limit": tidepool splits any block
    }


def register(torch) -> _patches.Patches:
    """Replaces the functions named at the top of this module (global mode only);
    remove() on the result puts PyTorch's back."""
    memory = torch.cuda.memory
    device_index = torch.cuda._utils._get_device_index

    since: dict[int, dict] = {}  # device -> _totals() at its last accumulated reset

    def memory_stats_as_nested_dict(device=None):
        if not torch.cuda.is_initialized():
            return {}  # as PyTorch: no CUDA work yet, nothing allocated
        d = device_index(device, optional=True)
        return nested_stats(d, since.get(d))

    def reset_accumulated_memory_stats(device=None):
        d = device_index(device, optional=True)
        since[d] = _totals(_stats.raw_stats(d))

    def reset_peak_memory_stats(device=None):
        fn = _lib.function("tidepool_reset_peak_stats", "peak statistics")
        d = device_index(device, optional=True)
        _lib.check(fn(d), f"resetting the peak statistics of device {d}")

    original_empty_cache = memory.empty_cache
    original_set_fraction = memory.set_per_process_memory_fraction

    def set_per_process_memory_fraction(fraction, device=None):
        original_set_fraction(fraction, device)  # validates, as PyTorch does
        d = device_index(device, optional=True)
        fn = _lib.function("tidepool_set_memory_fraction", "the memory fraction")
        _lib.check(fn(fraction, d), f"setting the memory fraction of device {d}")

    def get_per_process_memory_fraction(device=None):
        d = device_index(device, optional=True)
        fn = _lib.function("tidepool_get_memory_fraction", "the memory fraction")
        fraction = fn(d)
        _lib.check(-1 if fraction < 0 else 0, f"reading the memory fraction of device {d}")
        return fraction

    def empty_cache():
        original_empty_cache()
        fn = _lib.function("tidepool_empty_cache_all", "empty_cache")
        _lib.check(fn(), "empty_cache")

    patches = _patches.Patches()
    for fn in (memory_stats_as_nested_dict, reset_peak_memory_stats,
               reset_accumulated_memory_stats, empty_cache, set_per_process_memory_fraction,
               get_per_process_memory_fraction):
        original = getattr(memory, fn.__name__)
        # torch.cuda re-exports them; a name there still bound to PyTorch's is replaced too.
        if getattr(torch.cuda, fn.__name__, None) is original:
            patches.replace(torch.cuda, fn.__name__, fn)
        patches.replace(memory, fn.__name__, fn)
    return patches
