"""torch.cuda's memory statistics and empty_cache, answered by tidepool in global mode
when c10's CUDA allocator is torch's CUDAPluggableAllocator class (the fallback, without
libtidepool_torch_cuda.so; with that library c10 itself asks tidepool, and nothing here
is installed).

torch's CUDAPluggableAllocator raises for getDeviceStats, resetAccumulatedStats and
resetPeakStats ("does not yet support") and does nothing for emptyCache unless C++ hooks
are set, which its Python class cannot do. So under `tidepool.mode:global` a training
script that logs torch.cuda.max_memory_allocated() would stop with a RuntimeError, and
torch.cuda.empty_cache() would keep every cached byte. The package replaces, in
torch.cuda.memory and in torch.cuda:

  memory_stats_as_nested_dict   what memory_stats(), memory_allocated(),
                                max_memory_allocated(), memory_reserved(),
                                max_memory_reserved() and memory_summary() read:
                                tidepool_get_pytorch_stats_v1, the figures c10's
                                getDeviceStats gets from libtidepool_torch_cuda.so too;
  reset_peak_memory_stats       tidepool_reset_peak_stats;
  reset_accumulated_memory_stats
                                tidepool_pytorch_reset_accumulated_stats: the running
                                totals of these figures count from the call on;
                                tidepool's own totals (tidepool.stats()) are kept since
                                start, as the C ABI documents them;
  empty_cache                   PyTorch's, then tidepool_empty_cache_all;
  set_per_process_memory_fraction
                                PyTorch's (its checks), then tidepool_set_memory_fraction,
                                which torch's CUDAPluggableAllocator class would not reach:
                                the cap binds all of tidepool's memory on the device,
                                optimizer state in pointer-stable ranges included;
  get_per_process_memory_fraction
                                tidepool_get_memory_fraction (torch's pluggable class raises).

torch.accelerator's memory_stats, reset_peak_memory_stats, reset_accumulated_memory_stats
and empty_cache (and the readers built on memory_stats) are pointed at these too.

What the figures mean ("large_pool" repeats "all" and "small_pool" is zero: the statistics
are kept for all blocks, not per pool; optimizer state in pointer-stable ranges is reported
by tidepool.stats() instead, since it moves between device and host memory) is decided
once, in libtidepool: Note [PyTorch's view of the stats] in allocator/c_api.h.
"""

from __future__ import annotations

import ctypes

from . import _lib, _patches
from ._stats import Stat

_POOLS = ("all", "small_pool", "large_pool")  # TIDEPOOL_POOL_ALL, _SMALL, _LARGE


class PyTorchStatsV1(ctypes.Structure):
    """Mirror of tidepool_pytorch_stats_v1 (c10's DeviceStats); field for field, in order."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("version", ctypes.c_uint32),
        ("allocation", Stat * 3), ("segment", Stat * 3), ("active", Stat * 3),
        ("inactive_split", Stat * 3), ("allocated_bytes", Stat * 3),
        ("reserved_bytes", Stat * 3), ("active_bytes", Stat * 3),
        ("inactive_split_bytes", Stat * 3), ("requested_bytes", Stat * 3),
        ("num_alloc_retries", ctypes.c_uint64), ("num_ooms", ctypes.c_uint64),
        ("oversize_allocations", Stat), ("oversize_segments", Stat),
        ("num_sync_all_streams", ctypes.c_uint64), ("num_device_alloc", ctypes.c_uint64),
        ("num_device_free", ctypes.c_uint64), ("max_split_size", ctypes.c_int64),
    ]


def _stat(stat: Stat) -> dict:
    return {field: getattr(stat, field) for field in ("current", "peak", "allocated", "freed")}


def nested_stats(device: int) -> dict:
    """torch.cuda.memory_stats_as_nested_dict(device): the struct, in PyTorch's keys."""
    raw = PyTorchStatsV1()
    raw.struct_size = ctypes.sizeof(PyTorchStatsV1)
    fn = _lib.function("tidepool_get_pytorch_stats_v1", "PyTorch's memory statistics")
    _lib.check(fn(device, ctypes.byref(raw)), f"reading the memory statistics of device {device}")
    out: dict = {}
    for name, kind in PyTorchStatsV1._fields_[2:]:
        value = getattr(raw, name)
        if kind is Stat:
            out[name] = _stat(value)
        elif isinstance(value, ctypes.Array):
            out[name] = {pool: _stat(value[i]) for i, pool in enumerate(_POOLS)}
        else:
            out[name] = value
    return out


def register(torch) -> _patches.Patches:
    """Replaces the functions named at the top of this module (global mode on torch's
    pluggable class only); remove() on the result puts PyTorch's back."""
    memory = torch.cuda.memory
    device_index = torch.cuda._utils._get_device_index

    def memory_stats_as_nested_dict(device=None):
        if not torch.cuda.is_initialized():
            return {}  # as PyTorch: no CUDA work yet, nothing allocated
        return nested_stats(device_index(device, optional=True))

    def reset_accumulated_memory_stats(device=None):
        fn = _lib.function("tidepool_pytorch_reset_accumulated_stats",
                           "PyTorch's memory statistics")
        d = device_index(device, optional=True)
        _lib.check(fn(d), f"resetting the accumulated statistics of device {d}")

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
    _replace_accelerator_functions(torch, patches)
    return patches


def _replace_accelerator_functions(torch, patches: _patches.Patches) -> None:
    """torch.accelerator's memory functions (the device-generic face of the same figures)
    go to c10 directly (torch._C._accelerator_getDeviceStats, ...), which torch's
    pluggable class answers with "does not yet support": they are pointed at torch.cuda's,
    answered above. memory_allocated() and the other readers in torch.accelerator.memory
    call its memory_stats, so they follow."""
    accelerator_memory = getattr(getattr(torch, "accelerator", None), "memory", None)
    if accelerator_memory is None:  # a torch before torch.accelerator.memory
        return
    cuda_memory = torch.cuda.memory

    def memory_stats(device_index=None, /):
        return cuda_memory.memory_stats(device_index)

    def reset_peak_memory_stats(device_index=None, /):
        cuda_memory.reset_peak_memory_stats(device_index)

    def reset_accumulated_memory_stats(device_index=None, /):
        cuda_memory.reset_accumulated_memory_stats(device_index)

    def empty_cache():
        cuda_memory.empty_cache()

    for fn in (memory_stats, reset_peak_memory_stats, reset_accumulated_memory_stats,
               empty_cache):
        original = getattr(accelerator_memory, fn.__name__, None)
        if original is None:
            continue
        if getattr(torch.accelerator, fn.__name__, None) is original:
            patches.replace(torch.accelerator, fn.__name__, fn)
        patches.replace(accelerator_memory, fn.__name__, fn)
