"""tidepool.snapshot() and tidepool.stats() against the allocator's real state, through
random allocations and frees (small and large, untagged and under tags, some from
another thread) and empty_cache calls, on the host backend. After every operation the
snapshot must describe memory exactly:
  - each segment's part in use is tiled by its blocks, in address order, without gaps or
    overlaps, and no two segments overlap;
  - the allocated blocks are exactly the live allocations of the model, each with the
    size the request was rounded to, its requested bytes and its tag;
  - its stats, and tidepool.stats(), agree with the blocks: allocated and requested
    bytes, allocation count, reserved bytes (the segments' backed bytes), per-tag bytes
    and counts, and the tags' cached bytes add up to the cached total, every free block
    kept under a tag the sequence used.
TIDEPOOL_TEST_SEED draws other sequences; TIDEPOOL_TEST_SCALE makes them longer."""

from __future__ import annotations

import json

import pytest

from conftest import host_backend_script
from random_sequences import scaled, seeds

CHECKS = """
import random, threading
rng = random.Random(SEED)
lib = _lib.load()
lib.tidepool_malloc.restype = ctypes.c_void_p
lib.tidepool_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.tidepool_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
tags = ["", "activation", "snapshot random \\"quoted\\""]
used_tags = {t or "untagged" for t in tags}
live = {}  # address -> (requested bytes, tag name)
problems = []

def check(op, what):
    snap = tidepool.snapshot(0)
    st = snap["stats"]
    segments = sorted(snap["segments"], key=lambda s: int(s["address"], 16))
    allocated, end = {}, 0
    for seg in segments:
        base = int(seg["address"], 16)
        if base < end:
            problems.append((op, what, "segments overlap", seg["address"]))
        at = base
        for b in seg["blocks"]:
            if int(b["address"], 16) != at:
                problems.append((op, what, "a gap or overlap in segment", seg["address"]))
                break
            at += b["size"]
            if b["state"] == "allocated":
                allocated[int(b["address"], 16)] = (b["size"], b["requested"], b["tag"])
            elif b["last_tag"] not in used_tags:
                problems.append((op, what, "a free block kept under", b["last_tag"]))
        # The blocks tile the part of the segment in use (all of it, but for an
        # expandable segment's reserved address range).
        if at != base + seg["used"] or seg["used"] > seg["size"] or seg["backed"] > seg["size"]:
            problems.append((op, what, "blocks do not tile the segment", seg["address"]))
        end = base + seg["size"]
    if set(allocated) != set(live):
        problems.append((op, what, "allocated blocks", len(allocated), "live", len(live)))
        return
    for address, (size, requested, tag) in allocated.items():
        want_requested, want_tag = live[address]
        if (requested, tag) != (want_requested, want_tag or "untagged") or size < requested:
            problems.append((op, what, "block", size, requested, tag, want_requested, want_tag))
    sizes = sum(size for size, _, _ in allocated.values())
    expected = {
        "allocated": sizes, "requested": sum(r for _, r, _ in allocated.values()),
        "allocations": len(allocated), "reserved": sum(s["backed"] for s in segments)}
    for key, value in expected.items():
        if st[key]["current"] != value:
            problems.append((op, what, key, st[key]["current"], value))
    flat = tidepool.stats(0)
    if flat["allocated_bytes.all.current"] != sizes:
        problems.append((op, what, "stats() allocated", flat["allocated_bytes.all.current"], sizes))
    if flat["reserved_bytes.all.current"] != expected["reserved"]:
        problems.append((op, what, "stats() reserved", flat["reserved_bytes.all.current"]))
    # Note [Cached memory by tag]: every cached byte is under one tag.
    if sum(tag["cached_bytes"] for tag in snap["tags"]) != st["cached_bytes"]:
        problems.append((op, what, "cached by tag", [t["cached_bytes"] for t in snap["tags"]],
                         st["cached_bytes"]))
    for tag in snap["tags"]:
        mine = [s for s, _, t in allocated.values() if t == tag["name"]]
        if (tag["bytes"]["current"], tag["count"]) != (sum(mine), len(mine)):
            problems.append((op, what, "tag", tag["name"], tag["bytes"]["current"], tag["count"],
                             sum(mine), len(mine)))

def malloc_tagged(size, tag):
    with tidepool.region(tag) if tag else _nothing():
        return lib.tidepool_malloc(size, 0, None)

class _nothing:
    def __enter__(self): return self
    def __exit__(self, *exc): return False

def other_thread(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0] if result else None

for op in range(OPERATIONS):
    kind = rng.choices(["malloc", "free", "empty_cache"], weights=[50, 45, 5])[0]
    elsewhere = rng.random() < 0.2
    if kind == "malloc" or not live:
        size = rng.choice([rng.randint(1, 2048), rng.randint(2049, 1 << 20),
                           rng.randint(1 << 20, 12 << 20)])
        tag = rng.choice(tags)
        call = lambda: malloc_tagged(size, tag)
        address = other_thread(call) if elsewhere else call()
        if not address:
            problems.append((op, "malloc failed", tidepool._lib.load().tidepool_last_error()))
            break
        live[address] = (size, tag)
        kind = f"malloc {size} {tag!r}"
    elif kind == "free":
        address = rng.choice(list(live))
        size, _ = live.pop(address)
        call = lambda: lib.tidepool_free(address, size, 0, None)
        other_thread(call) if elsewhere else call()
    else:
        lib.tidepool_empty_cache(0)
    check(op, kind)
    if len(problems) > 5:
        break
for address, (size, _) in live.items():
    lib.tidepool_free(address, size, 0, None)
live.clear()
check(OPERATIONS, "all freed")
print(json.dumps({"problems": [list(map(str, p)) for p in problems]}))
"""


@pytest.mark.parametrize("seed", seeds(2))
def test_the_snapshot_describes_memory_exactly_through_random_use(run_python, seed):
    body = CHECKS.replace("SEED", str(seed)).replace("OPERATIONS", str(scaled(300)))
    result = run_python(host_backend_script(body))
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"problems": []}, result.stderr
