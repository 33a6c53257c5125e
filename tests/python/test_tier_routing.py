"""The allocator entry points PyTorch is given (tidepool_pytorch_malloc/free of
libtidepool.so, the names the package hands to CUDAPluggableAllocator): allocations under
optimizer_state of at least tidepool.tier_min_bytes become pointer-stable ranges that
evict() moves to host memory and prefetch() brings back, within tidepool.state_budget, at
the same address with the same bytes, prefetch and evict by pointers move only the
ranges named, and the ranges on the device beyond those named are listed; smaller state
and other tags go to the caching allocator. Tiering errors reach Python with tidepool's
message. Runs on the host backend (its "device" memory is
host RAM, so the test can read through the pointers), in a fresh interpreter because the
backend is chosen before the first allocation."""

from __future__ import annotations

import json

from conftest import host_backend_script

SCRIPT = """
import ctypes, json
import tidepool
from tidepool import _config, _lib, _tiering

_config.apply("backend:tidepool,tidepool.device_backend:host,tidepool.state_budget:5MiB")
lib = _lib.load()
malloc_name, free_name = _lib.PYTORCH_ENTRY_POINTS
malloc, free = getattr(lib, malloc_name), getattr(lib, free_name)
malloc.restype = ctypes.c_void_p
malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
owns = lib.tidepool_vmm_owns
owns.restype, owns.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]
MiB = 1 << 20
pattern = bytes(range(256)) * (4 * MiB // 256)

def figures():
    s = tidepool.stats(0)
    return {k: s[k] for k in ("allocated_bytes.all.current", "tiering.vmm_ranges",
                              "tiering.vmm_device_bytes", "tiering.vmm_host_bytes")}

out = {}
with tidepool.region("optimizer_state"):
    state = malloc(4 * MiB, 0, None)
    more_state = malloc(2 * MiB, 0, None)
    bias_state = malloc(64 << 10, 0, None)   # under tidepool.tier_min_bytes (1 MiB)
workspace = malloc(MiB, 0, None)
ctypes.memmove(state, pattern, len(pattern))
out["owns"] = [owns(p, 0) for p in (state, more_state, bias_state, workspace)]
out["allocated"] = figures()
tidepool.evict("optimizer_state", device=0)
out["evicted"] = figures()
out["intact_on_host"] = ctypes.string_at(state, len(pattern)) == pattern
out["left_on_host"] = tidepool.prefetch("optimizer_state", device=0)
out["prefetched"] = figures()
out["intact_after_prefetch"] = ctypes.string_at(state, len(pattern)) == pattern
# The 4 MiB range's host backing, freed by its move back, is kept for its next move out,
# until empty_cache (what torch.cuda.empty_cache() reaches) gives it back.
out["spare"] = tidepool.stats(0)["tiering.vmm_spare_host_bytes"]
assert lib.tidepool_empty_cache_all() == 0
out["spare_after_empty_cache"] = tidepool.stats(0)["tiering.vmm_spare_host_bytes"]
for p, n in ((state, 4 * MiB), (more_state, 2 * MiB), (bias_state, 64 << 10), (workspace, MiB)):
    free(p, n, 0, None)
out["freed"] = figures()
print(json.dumps(out))
"""


def test_optimizer_state_is_pointer_stable_migrates_and_prefetch_keeps_to_the_budget(run_python):
    out = json.loads(run_python(SCRIPT).stdout.strip().splitlines()[-1])
    MiB = 1 << 20
    assert out["owns"] == [1, 1, 0, 0]
    # The small state and the workspace are the caching allocator's (64 KiB + 1 MiB).
    assert out["allocated"]["allocated_bytes.all.current"] == MiB + (64 << 10)
    assert out["allocated"]["tiering.vmm_ranges"] == 2
    # New state goes where the budget puts it: the 4 MiB range on the device, the 2 MiB
    # one past the 5 MiB on the host.
    assert out["allocated"]["tiering.vmm_device_bytes"] == 4 * MiB
    assert out["allocated"]["tiering.vmm_host_bytes"] == 2 * MiB
    assert out["evicted"]["tiering.vmm_device_bytes"] == 0
    assert out["evicted"]["tiering.vmm_host_bytes"] == 6 * MiB
    assert out["intact_on_host"] and out["intact_after_prefetch"]
    # state_budget 5 MiB: the 4 MiB range (the oldest) comes back, the 2 MiB one stays.
    assert out["left_on_host"] == 2 * MiB
    assert out["prefetched"]["tiering.vmm_device_bytes"] == 4 * MiB
    assert out["prefetched"]["tiering.vmm_host_bytes"] == 2 * MiB
    assert out["spare"] == 4 * MiB and out["spare_after_empty_cache"] == 0
    assert out["freed"] == {"allocated_bytes.all.current": 0, "tiering.vmm_ranges": 0,
                            "tiering.vmm_device_bytes": 0, "tiering.vmm_host_bytes": 0}


def test_prefetch_and_evict_by_pointers_move_only_the_ranges_named(run_python):
    # What the optimizer pre-hook calls (Note [prefetch by pointer] in _state_moves.py):
    # one optimizer's state by its tensors' pointers, through the real C ABI; and what its
    # post-hook calls while another thread's step on the device still runs (Note [steps
    # in flight] in _in_flight.py): evict its own state, not the other's.
    out = json.loads(run_python(host_backend_script("""
        with tidepool.region("optimizer_state"):
            mine = [malloc(2 * MiB) for _ in range(3)]
            others = malloc(2 * MiB)
            small = malloc(64 << 10)   # under tidepool.tier_min_bytes
        tidepool.evict("optimizer_state", device=0)
        # The third first, also by a pointer inside it (a view), then the first two; the
        # small one and 0 (an empty tensor) are in no range.
        ptrs = [mine[2] + 4096, mine[2], small, 0, mine[0], mine[1]]
        left = _tiering.prefetch_ptrs(0, ptrs, None)
        s = tidepool.stats(0)
        out = {"left": left, "device": s["tiering.vmm_device_bytes"],
               "others_owned": _tiering.owns(0, others)}
        _tiering.evict_ptrs(0, [mine[2] + 4096, small, 0, mine[2]], None)
        out["device_after_evict"] = tidepool.stats(0)["tiering.vmm_device_bytes"]
        print(json.dumps(out))
        """, "tidepool.state_budget:5MiB")).stdout.strip().splitlines()[-1])
    MiB = 1 << 20
    # 5 MiB of budget: the third and the first (2 MiB each); the second would exceed it;
    # the other optimizer's range is not named and stays on the host. Evicting the third
    # by its pointers leaves the first on the device.
    assert out == {"left": 2 * MiB, "device": 4 * MiB, "others_owned": True,
                   "device_after_evict": 2 * MiB}


def test_the_ranges_on_the_device_beyond_those_named_are_listed_oldest_first(run_python):
    # What the optimizer post-hook asks (Note [state outside optimizer.state] in
    # _state_outside.py), through the real C ABI: the device-backed ranges of the tag that
    # hold none of the pointers named; past 64 of them the wrapper asks again with room
    # for all.
    out = json.loads(run_python(host_backend_script("""
        with tidepool.region("optimizer_state"):
            own = [malloc(2 * MiB) for _ in range(2)]
            outside = [malloc(2 * MiB) for _ in range(70)]
        tidepool.evict("optimizer_state", device=0)
        _tiering.prefetch_ptrs(0, own + outside[5:] + outside[:3], None)   # 3, 4 stay on the host
        listed = _tiering.device_ranges_except(0, tidepool._tags.OPTIMIZER_STATE,
                                               [own[0] + 4096, own[1], 0])
        print(json.dumps({"listed": listed, "expected": outside[:3] + outside[5:]}))
        """, "tidepool.state_budget:1GiB")).stdout.strip().splitlines()[-1])
    assert len(out["listed"]) == 68
    assert out["listed"] == out["expected"]


def test_a_range_is_told_from_a_later_one_at_its_address(run_python):
    # _tiering.range_ids through the real C ABI (Note [state outside optimizer.state]): an
    # interior pointer names its range, a freed range's address none, and a range made
    # later gets an id of its own, also where it takes the freed address. The kernel
    # usually hands a freed address back to the next reservation; the script frees and
    # makes ranges until that happens (a few rounds at most), so the case is always met.
    out = json.loads(run_python(host_backend_script("""
        free = getattr(_lib.load(), _lib.PYTORCH_ENTRY_POINTS[1])
        free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        with tidepool.region("optimizer_state"):
            first, second = malloc(2 * MiB), malloc(2 * MiB)
        out = {"ids": _tiering.range_ids(0, [first, first + 4096, second, 0]),
               "rounds": []}
        for _ in range(16):
            free(first, 2 * MiB, 0, None)
            gone = _tiering.range_ids(0, [first])
            with tidepool.region("optimizer_state"):
                later = [malloc(2 * MiB) for _ in range(4)]
            out["rounds"].append({"first": first, "gone": gone, "later": later,
                                  "later_ids": _tiering.range_ids(0, later),
                                  "at_first": _tiering.range_ids(0, [first])})
            if first in later:
                break
            first = later[0]
        print(json.dumps(out))
        """, "tidepool.state_budget:1GiB")).stdout.strip().splitlines()[-1])
    ids = out["ids"]
    assert ids[0] != 0 and ids[1] == ids[0] and ids[2] not in (0, ids[0]) and ids[3] == 0
    every_id = [ids[0], ids[2]]
    for r in out["rounds"]:
        assert r["gone"] == [0]
        every_id += r["later_ids"]
        taken = [i for p, i in zip(r["later"], r["later_ids"]) if p == r["first"]]
        assert r["at_first"] == (taken if taken else [0])
    assert 0 not in every_id and len(set(every_id)) == len(every_id)  # never given twice
    assert out["rounds"][-1]["first"] in out["rounds"][-1]["later"], \
        "no later range took a freed address in 16 rounds: the case this test is for"


def test_a_tiering_failure_reaches_python_with_tidepools_message(run_python):
    # The tiering C ABI reports into tidepool_last_error, which the package reads.
    out = run_python("""
        from tidepool import _config, _tiering
        _config.apply("backend:tidepool,tidepool.device_backend:host")
        for call in (lambda: _tiering.prefetch_tag(-1, 4, None), lambda: _tiering.evict_tag(-1, 4)):
            try:
                call()
            except RuntimeError as e:
                print(e)
        """).stdout.strip().splitlines()
    no_device = "tidepool: device -1 does not exist (the host backend has devices 0..15)"
    assert out == [
        "tidepool: prefetching tag 4 on device -1 failed: tidepool_prefetch_tag_within_budget: "
        + no_device,
        "tidepool: evicting tag 4 on device -1 failed: tidepool_evict_tag: " + no_device]


def test_an_eviction_with_nothing_on_the_device_does_not_wait(run_python):
    # The optimizer post-hook evicts the tag after every step; with state_budget:0 new
    # state is made on the host and never prefetched, so there is nothing to move, and
    # the wait for the step's stream (a host synchronisation) used to come every step.
    out = json.loads(run_python(host_backend_script("""
        waits = []
        _tiering._synchronize = lambda device, stream: waits.append(stream)
        with tidepool.region("optimizer_state"):
            state = malloc(2 * MiB)   # within the budget: made on the device
        out = {"device_first": tidepool.stats(0)["tiering.vmm_device_bytes"]}
        _tiering.evict_tag(0, tidepool._tags.OPTIMIZER_STATE, 1234)
        out["waits_when_on_device"] = list(waits)
        out["device_after"] = tidepool.stats(0)["tiering.vmm_device_bytes"]
        _tiering.evict_tag(0, tidepool._tags.OPTIMIZER_STATE, 1234)
        out["waits"] = waits
        print(json.dumps(out))
        """, "tidepool.state_budget:4MiB")).stdout.strip().splitlines()[-1])
    assert out == {"device_first": 2 << 20, "waits_when_on_device": [1234],
                   "device_after": 0, "waits": [1234]}


def test_an_eviction_pins_no_more_than_the_pinned_budget(run_python):
    # Note [Pinned host backings] (tiering/vmm_backings.cpp): the host backings of the
    # ranges are pinned memory, charged to tidepool.pinned_budget with the tiered stores'.
    # 6 MiB holds one of two 4 MiB ranges: the eviction moves the first, keeps the second
    # on the device (every byte in place), says so once, and the stats show it.
    result = run_python(host_backend_script("""
        with tidepool.region("optimizer_state"):
            first = malloc(4 * MiB)
            second = malloc(4 * MiB)
        ctypes.memset(first, 0x11, 4 * MiB)
        ctypes.memset(second, 0x22, 4 * MiB)
        tidepool.evict("optimizer_state", device=0)
        s = tidepool.stats(0)
        out = {k: s["tiering." + k] for k in (
            "vmm_device_bytes", "vmm_host_bytes", "vmm_pinned_bytes", "vmm_pinned_budget_stops",
            "vmm_bytes_left_on_device", "pinned_budget_bytes", "process_pinned_bytes")}
        out["intact"] = (ctypes.string_at(first, 4 * MiB) == b"\\x11" * (4 * MiB)
                         and ctypes.string_at(second, 4 * MiB) == b"\\x22" * (4 * MiB))
        print(json.dumps(out))
        """, "tidepool.state_budget:1GiB,tidepool.pinned_budget:6MiB"))
    out = json.loads(result.stdout.strip().splitlines()[-1])
    MiB = 1 << 20
    assert out == {"vmm_device_bytes": 4 * MiB, "vmm_host_bytes": 4 * MiB,
                   "vmm_pinned_bytes": 4 * MiB, "vmm_pinned_budget_stops": 1,
                   "vmm_bytes_left_on_device": 4 * MiB, "pinned_budget_bytes": 6 * MiB,
                   "process_pinned_bytes": 4 * MiB, "intact": True}
    assert result.stderr.count("pinned host budget") == 1, result.stderr
