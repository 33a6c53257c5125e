"""tidepool.stats() and tidepool.snapshot(): the allocator's versioned stats struct
(tidepool_stats_v1, allocator/c_api.h) flattened into keys in the style of
torch.cuda.memory_stats(), plus per-tag figures ("tag.<name>.current", ...) that
PyTorch cannot give for a pluggable allocator."""

from __future__ import annotations

import ctypes
import json

from . import _lib
from ._tags import TAG_MAX


class Stat(ctypes.Structure):
    _fields_ = [("current", ctypes.c_uint64), ("peak", ctypes.c_uint64),
                ("allocated", ctypes.c_uint64), ("freed", ctypes.c_uint64)]


class TagStats(ctypes.Structure):
    _fields_ = [("bytes", Stat), ("count", ctypes.c_uint64), ("total_count", ctypes.c_uint64)]


class TagCache(ctypes.Structure):
    _fields_ = [("cached_bytes", ctypes.c_uint64), ("largest_free_block", ctypes.c_uint64),
                ("fragmentation", ctypes.c_double)]


class StatsV1(ctypes.Structure):
    """Mirror of tidepool_stats_v1; field for field, in order."""
    _fields_ = [
        ("struct_size", ctypes.c_uint32), ("version", ctypes.c_uint32),
        ("device", ctypes.c_int32), ("backend", ctypes.c_int32),
        ("allocated", Stat), ("reserved", Stat),
        ("cached_bytes", ctypes.c_uint64),
        ("segments_acquired", ctypes.c_uint64), ("segments_released", ctypes.c_uint64),
        ("alloc_count", ctypes.c_uint64), ("free_count", ctypes.c_uint64),
        ("cache_hits", ctypes.c_uint64), ("cache_misses", ctypes.c_uint64),
        ("oom_count", ctypes.c_uint64),
        ("reclaim_calls", ctypes.c_uint64), ("reclaimed_bytes", ctypes.c_uint64),
        ("fragmentation", ctypes.c_double),
        ("tags", TagStats * TAG_MAX),
        # appended after the first release of v1 (a shorter struct_size gets the prefix)
        ("requested", Stat), ("cross_stream_reuses", ctypes.c_uint64),
        ("allocations", Stat), ("segments", Stat),  # counts, with their peaks
        ("largest_free_block", ctypes.c_uint64),
        ("tag_cache", TagCache * TAG_MAX),  # cached memory by tag
    ]


def _stat_keys(out: dict, prefix: str, stat: Stat) -> None:
    for field in ("current", "peak", "allocated", "freed"):
        out[f"{prefix}.{field}"] = getattr(stat, field)


def raw_stats(device: int) -> StatsV1:
    """The allocator's stats struct of `device`, as the C ABI fills it."""
    raw = StatsV1()
    raw.struct_size = ctypes.sizeof(StatsV1)
    fn = _lib.function("tidepool_get_stats_v1", "allocator statistics")
    _lib.check(fn(device, ctypes.byref(raw)), f"reading stats of device {device}")
    return raw


def stats(device: int = 0) -> dict:
    raw = raw_stats(device)
    out: dict = {"backend": "cuda" if raw.backend == 1 else "host", "device": raw.device}
    _stat_keys(out, "allocated_bytes.all", raw.allocated)
    _stat_keys(out, "reserved_bytes.all", raw.reserved)
    _stat_keys(out, "requested_bytes.all", raw.requested)
    out["num_cross_stream_reuses"] = raw.cross_stream_reuses
    # Free memory tidepool keeps reserved (reserved − allocated): all of it releasable, so
    # not PyTorch's inactive_split_bytes (split blocks that cannot be given back).
    out["cached_bytes"] = raw.cached_bytes
    _stat_keys(out, "segment.all", raw.segments)
    _stat_keys(out, "allocation.all", raw.allocations)
    out["num_ooms"] = raw.oom_count
    out["num_alloc_retries"] = raw.reclaim_calls
    out["num_cache_hits"] = raw.cache_hits
    out["num_cache_misses"] = raw.cache_misses
    out["reclaimed_bytes"] = raw.reclaimed_bytes
    out["largest_free_block"] = raw.largest_free_block
    out["fragmentation"] = raw.fragmentation
    from . import _tags

    for tag in range(TAG_MAX):
        t = raw.tags[tag]
        if t.total_count == 0 and t.bytes.allocated == 0:
            continue
        name = _tags.tag_name(tag) or f"tag{tag}"
        _stat_keys(out, f"tag.{name}", t.bytes)
        out[f"tag.{name}.count"] = t.count
        out[f"tag.{name}.total_count"] = t.total_count
        # Free memory kept under the tag (Note [Cached memory by tag] in
        # allocator/snapshot.cpp): the tags' figures add up to cached_bytes.
        cache = raw.tag_cache[tag]
        out[f"tag.{name}.cached_bytes"] = cache.cached_bytes
        out[f"tag.{name}.largest_free_block"] = cache.largest_free_block
        out[f"tag.{name}.fragmentation"] = cache.fragmentation
    from . import _adoption, _tiering

    out.update(_tiering.transfer_stats(device))
    out.update(_adoption.stats(device))
    return out


def snapshot(device: int = 0) -> dict:
    fn = _lib.function("tidepool_snapshot_json", "allocator snapshots")
    text = fn(device)
    if not text:
        _lib.check(-1, f"snapshot of device {device}")
    try:
        return json.loads(ctypes.string_at(text).decode("utf-8"))
    finally:
        _lib.function("tidepool_string_free", "allocator snapshots")(text)
