"""libtidepool_pluggable.so, the malloc/free pair PyTorch is given: allocations made
under the optimizer_state tag become pointer-stable VMM ranges that evict() moves to
host memory and prefetch() brings back at the same address with the same bytes; all
other allocations go to the caching allocator. Runs on the host backend (its "device"
memory is host RAM, so the test can read through the pointers), in a fresh interpreter
because the backend is chosen before the first allocation."""

from __future__ import annotations

import json

SCRIPT = """
import ctypes, json
import tidepool
from tidepool import _config, _lib, _stats

_config.apply("backend:tidepool,tidepool.device_backend:host")
lib = _lib.load()
router = ctypes.CDLL(_lib.pluggable_path())
router.tidepool_pluggable_malloc.restype = ctypes.c_void_p
router.tidepool_pluggable_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
router.tidepool_pluggable_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
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
    state = router.tidepool_pluggable_malloc(4 * MiB, 0, None)
workspace = router.tidepool_pluggable_malloc(MiB, 0, None)
ctypes.memmove(state, pattern, len(pattern))
out["owns"] = [owns(state, 0), owns(workspace, 0)]
out["allocated"] = figures()
tidepool.evict("optimizer_state", device=0)
out["evicted"] = figures()
out["intact_on_host"] = ctypes.string_at(state, len(pattern)) == pattern
tidepool.prefetch("optimizer_state", device=0)
out["prefetched"] = figures()
out["intact_on_device"] = ctypes.string_at(state, len(pattern)) == pattern
router.tidepool_pluggable_free(state, 4 * MiB, 0, None)
router.tidepool_pluggable_free(workspace, MiB, 0, None)
out["freed"] = figures()
print(json.dumps(out))
"""


def test_optimizer_state_is_pointer_stable_and_migrates(run_python):
    out = json.loads(run_python(SCRIPT).stdout.strip().splitlines()[-1])
    MiB = 1 << 20
    assert out["owns"] == [1, 0]
    # Only the workspace allocation is the caching allocator's.
    assert out["allocated"]["allocated_bytes.all.current"] == MiB
    assert out["allocated"]["tiering.vmm_ranges"] == 1
    assert out["allocated"]["tiering.vmm_device_bytes"] >= 4 * MiB
    assert out["evicted"]["tiering.vmm_device_bytes"] == 0
    assert out["evicted"]["tiering.vmm_host_bytes"] >= 4 * MiB
    assert out["intact_on_host"] and out["intact_on_device"]
    assert out["prefetched"]["tiering.vmm_device_bytes"] >= 4 * MiB
    assert out["prefetched"]["tiering.vmm_host_bytes"] == 0
    assert out["freed"] == {"allocated_bytes.all.current": 0, "tiering.vmm_ranges": 0,
                            "tiering.vmm_device_bytes": 0, "tiering.vmm_host_bytes": 0}
