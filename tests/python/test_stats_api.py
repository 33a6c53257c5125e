"""tidepool.stats() / snapshot() / region() / evict() / prefetch() against the real
libtidepool on its host backend (the "device" memory is host RAM, so this runs without
a GPU). One fresh interpreter: the backend must be chosen before the first allocation."""

from __future__ import annotations

import json

import pytest

SCRIPT = """
import ctypes, json
import tidepool
from tidepool import _config, _lib, _stats, _tags

# tier_min_bytes above 1 MiB: the optimizer_state allocation below stays in the caching
# allocator, whose per-tag stats this test reads (routing: test_tier_routing.py).
_config.apply("backend:tidepool,tidepool.device_backend:host,tidepool.tier_min_bytes:2MiB")
lib = _lib.load()
out = {}
MiB = 1 << 20
with tidepool.region("kv_cache") as kv:
    a = lib.tidepool_malloc(3 * MiB, 0, None)
    with tidepool.region("optimizer_state"):
        b = lib.tidepool_malloc(MiB, 0, None)
    c = lib.tidepool_malloc(MiB, 0, None)
out["ptrs_ok"] = all((a, b, c))
s = tidepool.stats(0)
out["during"] = {k: v for k, v in s.items()
                 if k.startswith(("tag.", "allocated_bytes.all", "requested_bytes.all"))}
out["backend"] = s["backend"]
out["allocation_current"] = s["allocation.all.current"]
out["has_transfer_keys"] = any(k.startswith("transfer.") for k in s)
snap = tidepool.snapshot(0)
out["snapshot_keys"] = sorted(snap)
tidepool.evict("kv_cache", device=0)
tidepool.prefetch("kv_cache", device=0)
for p, n in ((a, 3 * MiB), (b, MiB), (c, MiB)):
    lib.tidepool_free(p, n, 0, None)
after = tidepool.stats(0)
out["after"] = {k: after[k] for k in ("allocated_bytes.all.current", "allocated_bytes.all.peak",
                                      "tag.kv_cache.current", "tag.kv_cache.freed")}
out["cached"] = {k: v for k, v in after.items()
                 if k in ("cached_bytes", "largest_free_block", "fragmentation")
                 or k.endswith((".cached_bytes", ".largest_free_block", ".fragmentation"))}
try:
    tidepool.stats(99)
except RuntimeError as e:
    out["bad_device"] = str(e)
try:
    with tidepool.region(""):
        pass
except ValueError as e:
    out["bad_tag"] = str(e)


def outcome(call):
    try:
        return ["returned", call()]
    except (TypeError, ValueError) as e:
        return [type(e).__name__, str(e)]


def tag_names():
    return [_tags.tag_name(i) for i in range(_stats.TAG_MAX)]


names_before = tag_names()
out["unknown_tag_ids"] = [outcome(lambda: tidepool.evict(999, device=0)),
                          outcome(lambda: tidepool.prefetch(-1, device=0)),
                          # a C int would wrap to 4 (optimizer_state), and 2**32 to device 0
                          outcome(lambda: tidepool.evict(2**32 + 4, device=0)),
                          outcome(lambda: tidepool.stats(2**32)),
                          outcome(lambda: tidepool.evict("optimizer_state", device=2**32))]
out["names_never_made"] = [outcome(lambda: tidepool.evict("never_made", device=0)),
                           outcome(lambda: tidepool.prefetch("never_made", device=0))]
out["tag_table_unchanged"] = tag_names() == names_before
prefetches_before = tidepool.stats(0)["tiering.prefetch_issued"]
out["bad_stream"] = outcome(lambda: tidepool.prefetch("kv_cache", device=0, stream="x"))
out["nothing_prefetched"] = tidepool.stats(0)["tiering.prefetch_issued"] == prefetches_before
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def report(run_python_module):
    result = run_python_module(SCRIPT)
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def run_python_module():
    import subprocess
    import sys

    from conftest import clean_env

    def run(code):
        result = subprocess.run([sys.executable, "-c", code], env=clean_env(),
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        return result
    return run


def test_stats_count_bytes_per_tag_in_torch_style_keys(report):
    MiB = 1 << 20
    assert report["ptrs_ok"]
    assert report["backend"] == "host"
    during = report["during"]
    assert during["allocated_bytes.all.current"] == 5 * MiB
    assert during["allocated_bytes.all.peak"] == 5 * MiB
    assert during["requested_bytes.all.current"] == 5 * MiB
    assert during["tag.kv_cache.current"] == 4 * MiB
    assert during["tag.kv_cache.count"] == 2
    assert during["tag.optimizer_state.current"] == MiB
    assert during["tag.optimizer_state.total_count"] == 1
    assert report["allocation_current"] == 3
    assert report["has_transfer_keys"]


def test_frees_show_in_current_and_freed_and_peak_stays(report):
    MiB = 1 << 20
    assert report["after"] == {"allocated_bytes.all.current": 0,
                               "allocated_bytes.all.peak": 5 * MiB,
                               "tag.kv_cache.current": 0, "tag.kv_cache.freed": 4 * MiB}


def test_snapshot_is_parsed_json(report):
    assert {"segments", "stats", "tags"} <= set(report["snapshot_keys"])


def test_errors_are_clear(report):
    assert report["bad_device"].startswith("tidepool: reading stats of device 99 failed")
    assert report["bad_tag"] == "tidepool: a tag is a non-empty name or an id, not ''"


def test_evict_and_prefetch_refuse_an_id_that_names_no_tag(report):
    # The C ABI takes any id and moves nothing: a wrong id would pass unnoticed.
    assert report["unknown_tag_ids"] == [
        ["ValueError", "tidepool: no tag has the id 999"],
        ["ValueError", "tidepool: no tag has the id -1"],
        ["ValueError", f"tidepool: no tag has the id {2**32 + 4}"],
        ["ValueError", f"tidepool: {2**32} is not a CUDA device index"],
        ["ValueError", f"tidepool: {2**32} is not a CUDA device index"]]


def test_evict_and_prefetch_of_a_name_never_used_move_nothing_and_create_no_tag(report):
    # Nothing was allocated under it; creating it would use up one of the 64 tag ids.
    assert report["names_never_made"] == [["returned", None], ["returned", 0]]
    assert report["tag_table_unchanged"]


def test_a_stream_that_is_not_one_is_refused_before_anything_moves(report):
    # ctypes would pass a str to CUDA as a stream handle (a pointer to its characters).
    assert report["bad_stream"] == [
        "TypeError", "tidepool: stream must be a torch.cuda.Stream, a stream handle (int) or "
        "None, not 'x'"]
    assert report["nothing_prefetched"]


def test_cached_memory_is_broken_down_by_tag(report):
    # Note [Cached memory by tag]: every cached byte is under one tag; kv_cache's freed
    # 3 MiB block (and more) is kept under kv_cache.
    cached = report["cached"]
    tags = {key.split(".")[1] for key in cached if key.startswith("tag.")}
    assert {"kv_cache", "optimizer_state"} <= tags
    assert sum(cached[f"tag.{t}.cached_bytes"] for t in tags) == cached["cached_bytes"] > 0
    assert cached["tag.kv_cache.cached_bytes"] >= 3 << 20
    for t in tags:
        assert cached[f"tag.{t}.largest_free_block"] <= cached[f"tag.{t}.cached_bytes"]
        assert cached[f"tag.{t}.largest_free_block"] <= cached["largest_free_block"]
        assert 0.0 <= cached[f"tag.{t}.fragmentation"] < 1.0
