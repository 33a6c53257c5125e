"""The LD_PRELOAD shim's calls it forwards but watches (Note [calls the shim watches] in
preload/watched_calls.cpp), the devices it leaves to the runtime, and what it says at exit
when no CUDA call could reach it (Note [a program the shim cannot see] in
preload/libraries.cpp), against the stand-in libcudart (fake_cudart.c) and, for the exit
check, a stand-in libcuda (fake_libcuda.c)."""

from __future__ import annotations

import os
import shutil

import pytest

from preload_fake import FAKE_CUDART, PRELOAD, needs_fake, needs_preload, run_with_fake

pytestmark = [needs_preload, needs_fake]

FAKE_LIBCUDA = os.environ.get("TIDEPOOL_TEST_FAKE_LIBCUDA", "")

OTHER_ALLOCATIONS = """
import tidepool
process.cudaMallocPitch.argtypes = [c_void_p, c_void_p, ctypes.c_size_t, ctypes.c_size_t]
reserved = lambda: tidepool.stats(0)["reserved_bytes.all.current"]
p = c_void_p()
process.cudaMalloc(byref(p), 8 << 20)
process.cudaFree(p)                            # tidepool keeps it cached
out["cached"] = reserved() >= 8 << 20
if os.environ.get("PENDING"):                  # a program error not read yet
    out["pending_rc"] = process.cudaFree(c_void_p(0x1234))
q, pitch = c_void_p(), ctypes.c_size_t()
out["rc"] = process.cudaMallocPitch(byref(q), byref(pitch), 1024, 64)
out["calls"] = counter("fake_cudart_other_malloc_calls")
out["cache_given_back"] = reserved() == 0
out["last_error"] = process.cudaGetLastError()
out["then"] = process.cudaGetLastError()
if out["rc"] == 0:
    out["free_rc"] = process.cudaFree(q)       # the runtime's memory goes back to it
    out["frees"] = counter("fake_cudart_free_calls")
"""


@pytest.mark.parametrize("ooms, expected", [
    # Review finding: memory freed through cudaFree stayed in tidepool's cache, so the
    # runtime's own allocations failed under the shim where they succeed without it.
    (1, {"rc": 0, "calls": 2, "cache_given_back": True, "last_error": 0, "then": 0,
         "free_rc": 0, "frees": 1}),
    # Still out of memory after the cache came back: the runtime's answer, and the last
    # error the failed call leaves.
    (2, {"rc": 2, "calls": 2, "cache_given_back": True, "last_error": 2, "then": 0}),
    # Enough memory: one call, and the cache stays.
    (0, {"rc": 0, "calls": 1, "cache_given_back": False, "last_error": 0, "then": 0,
         "free_rc": 0, "frees": 1}),
], ids=["retried", "still-out-of-memory", "not-needed"])
def test_other_allocations_get_tidepools_cache_back_when_the_runtime_runs_out(
        run_python, ooms, expected):
    out, _ = run_with_fake(run_python, OTHER_ALLOCATIONS, TIDEPOOL_BACKEND="host",
                           FAKE_CUDART_OTHER_OOM=str(ooms))
    assert out == {"cached": True, **expected}


def test_a_retried_allocation_keeps_the_programs_pending_error(run_python):
    # Note [last error]: the first answer's cudaErrorMemoryAllocation is the shim's, not
    # the program's; the error the program had not read yet is still there after.
    out, _ = run_with_fake(run_python, OTHER_ALLOCATIONS, TIDEPOOL_BACKEND="host",
                           FAKE_CUDART_OTHER_OOM="1", PENDING="1")
    assert out["pending_rc"] == 1 and out["rc"] == 0 and out["calls"] == 2
    assert (out["last_error"], out["then"]) == (1, 0)


def test_managed_and_pool_allocations_are_retried_too(run_python):
    out, _ = run_with_fake(run_python, """
process.cudaMallocManaged.argtypes = [c_void_p, ctypes.c_size_t, ctypes.c_uint]
process.cudaMallocFromPoolAsync.argtypes = [c_void_p, ctypes.c_size_t, c_void_p, c_void_p]
p = c_void_p()
process.cudaMalloc(byref(p), 4 << 20)
process.cudaFree(p)
m, f = c_void_p(), c_void_p()
out["managed"] = process.cudaMallocManaged(byref(m), 4096, 1)
process.cudaMalloc(byref(p), 4 << 20)
process.cudaFree(p)
out["from_pool"] = process.cudaMallocFromPoolAsync(byref(f), 4096, c_void_p(0x7000), None)
out["calls"] = counter("fake_cudart_other_malloc_calls")
""", TIDEPOOL_BACKEND="host", FAKE_CUDART_OTHER_OOM="1")
    # The first answer of each fails once (the knob counts across them: only the first).
    assert out == {"managed": 0, "from_pool": 0, "calls": 3}


def test_per_thread_pool_allocations_are_retried_too(run_python):
    # Review finding: a program built with --default-stream per-thread calls the _ptsz form.
    out, _ = run_with_fake(run_python, """
process.cudaMallocFromPoolAsync_ptsz.argtypes = [c_void_p, ctypes.c_size_t, c_void_p, c_void_p]
p = c_void_p()
process.cudaMalloc(byref(p), 4 << 20)
process.cudaFree(p)
f = c_void_p()
out["rc"] = process.cudaMallocFromPoolAsync_ptsz(byref(f), 4096, c_void_p(0x7000), None)
out["calls"] = counter("fake_cudart_other_malloc_calls")
""", TIDEPOOL_BACKEND="host", FAKE_CUDART_OTHER_OOM="1")
    assert out == {"rc": 0, "calls": 2}


def test_a_device_tidepool_never_served_has_no_cache_to_give(run_python):
    # Review finding: giving back the cache of a device tidepool never allocated on made
    # its allocator, right after the runtime ran out of memory there.
    out, _ = run_with_fake(run_python, """
import tidepool
process.cudaMallocPitch.argtypes = [c_void_p, c_void_p, ctypes.c_size_t, ctypes.c_size_t]
p = c_void_p()
process.cudaMalloc(byref(p), 4 << 20)           # device 0
process.cudaFree(p)
os.environ["FAKE_CUDART_DEVICE"] = "3"
q, pitch = c_void_p(), ctypes.c_size_t()
out["rc"] = process.cudaMallocPitch(byref(q), byref(pitch), 1024, 64)
out["calls"] = counter("fake_cudart_other_malloc_calls")
out["device_0_kept_its_cache"] = tidepool.stats(0)["reserved_bytes.all.current"] >= 4 << 20
""", TIDEPOOL_BACKEND="host", FAKE_CUDART_OTHER_OOM="1")
    assert out == {"rc": 2, "calls": 1, "device_0_kept_its_cache": True}


def test_before_tidepool_is_set_up_another_allocation_is_forwarded_once(run_python):
    # Lazy set-up (nothing names tidepool, no cudaMalloc yet): there is no cache to give.
    out, _ = run_with_fake(run_python, """
process.cudaMallocPitch.argtypes = [c_void_p, c_void_p, ctypes.c_size_t, ctypes.c_size_t]
q, pitch = c_void_p(), ctypes.c_size_t()
out["rc"] = process.cudaMallocPitch(byref(q), byref(pitch), 1024, 64)
out["calls"] = counter("fake_cudart_other_malloc_calls")
out["last_error"] = process.cudaGetLastError()
""", TIDEPOOL_BACKEND="host", FAKE_CUDART_OTHER_OOM="1")
    assert out == {"rc": 2, "calls": 1, "last_error": 2}


PROGRAM_POOLS = """
process.cudaDeviceSetMemPool.argtypes = [ctypes.c_int, c_void_p]
process.cudaMemPoolSetAccess.argtypes = [c_void_p, c_void_p, ctypes.c_size_t]
def stream_ordered(device):
    os.environ["FAKE_CUDART_STREAM_DEVICE"] = str(device)
    before = counter("fake_cudart_malloc_async_calls")
    p = c_void_p()
    rc = process.cudaMallocAsync(byref(p), 1 << 20, None)
    forwarded = counter("fake_cudart_malloc_async_calls") - before
    frees = counter("fake_cudart_free_async_calls")
    free_rc = process.cudaFreeAsync(p, None)
    # The runtime's pointer goes back to the runtime, tidepool's to tidepool.
    assert free_rc == 0 and counter("fake_cudart_free_async_calls") - frees == forwarded
    return "runtime" if (rc, forwarded) == (0, 1) else "tidepool" if rc == 0 else rc
if os.environ.get("EARLY"):                     # before tidepool is set up
    out["set_early"] = process.cudaDeviceSetMemPool(0, c_void_p(0x9999))
q = c_void_p()
process.cudaMalloc(byref(q), 1 << 20)           # tidepool is set up (lazily)
out["start"] = stream_ordered(0)
out["set_own"] = process.cudaDeviceSetMemPool(0, c_void_p(0x9999))
out["own_pool"] = stream_ordered(0)
out["other_device"] = stream_ordered(1)
before = counter("fake_cudart_malloc_calls")
r = c_void_p()
process.cudaMalloc(byref(r), 1 << 20)
out["cudaMalloc_stays_tidepools"] = counter("fake_cudart_malloc_calls") == before
process.cudaFree(r)
out["set_default"] = process.cudaDeviceSetMemPool(0, c_void_p(0x7000))
out["default_again"] = stream_ordered(0)
out["access"] = process.cudaMemPoolSetAccess(c_void_p(0x7001), None, 0)
out["shared_default_pool"] = stream_ordered(1)
process.cudaDeviceSetMemPool(1, c_void_p(0x7001))
out["still_shared"] = stream_ordered(1)
out["device_0"] = stream_ordered(0)
out["last_error"] = process.cudaGetLastError()
"""


def test_a_device_given_a_pool_of_the_programs_own_allocates_from_it(run_python):
    # Review finding: cudaMallocAsync was served by tidepool whatever the device's current
    # pool, so a pool the program made current, or access it gave other devices to the
    # default pool, did not apply to the memory it got.
    out, stderr = run_with_fake(run_python, PROGRAM_POOLS, TIDEPOOL_BACKEND="host")
    assert out == {
        "start": "tidepool", "set_own": 0, "own_pool": "runtime", "other_device": "tidepool",
        "cudaMalloc_stays_tidepools": True, "set_default": 0, "default_again": "tidepool",
        "access": 0, "shared_default_pool": "runtime", "still_shared": "runtime",
        "device_0": "tidepool", "last_error": 0}
    assert stderr.count("a memory pool of its own") == 1, stderr


def test_a_pool_set_before_tidepool_is_set_up_counts(run_python):
    out, _ = run_with_fake(run_python, PROGRAM_POOLS, TIDEPOOL_BACKEND="host", EARLY="1")
    assert out["set_early"] == 0
    assert out["start"] == "runtime"


def test_a_device_tidepool_cannot_serve_goes_to_the_runtime(run_python):
    # Review finding: devices at and above tidepool's kMaxDevices (16) got
    # cudaErrorInvalidValue for every allocation instead of the runtime's memory.
    out, stderr = run_with_fake(run_python, """
p, q = c_void_p(), c_void_p()
out["malloc"] = process.cudaMalloc(byref(p), 1 << 20)
out["malloc_calls"] = counter("fake_cudart_malloc_calls")
out["free"] = process.cudaFree(p)
out["free_calls"] = counter("fake_cudart_free_calls")
os.environ["FAKE_CUDART_STREAM_DEVICE"] = "17"
out["async"] = process.cudaMallocAsync(byref(q), 1 << 20, None)
out["async_calls"] = counter("fake_cudart_malloc_async_calls")
out["free_async"] = process.cudaFreeAsync(q, None)
s = c_void_p()
fake.cudaStreamCreate(byref(s))
out["destroy"] = process.cudaStreamDestroy(s)  # a stream of device 17: nothing to release
process.cudaDeviceReset.argtypes = []
out["reset"] = process.cudaDeviceReset()        # device 16: never served, nothing to say
out["last_error"] = process.cudaGetLastError()
""", TIDEPOOL_BACKEND="host", FAKE_CUDART_DEVICE="16")
    assert out == {"malloc": 0, "malloc_calls": 1, "free": 0, "free_calls": 1, "async": 0,
                   "async_calls": 1, "free_async": 0, "destroy": 0, "reset": 0,
                   "last_error": 0}
    assert "tidepool preload" not in stderr, stderr


# Note [a program the shim cannot see]: programs run with the shim preloaded and no
# variables; LIBCUDA, when set, is loaded (a process that used CUDA); RUNTIME, when set, is
# the fake runtime loaded in that mode ("local": RTLD_LOCAL, called through its handle;
# "global"); CALL makes one call of the shim's.
EXIT_PROGRAM = """
import ctypes, os
if os.environ.get("LIBCUDA"):
    ctypes.CDLL(os.environ["LIBCUDA"])
if os.environ.get("LIBC10_CUDA"):              # PyTorch's CUDA library, by its name
    ctypes.CDLL(os.environ["LIBC10_CUDA"])
mode = os.environ.get("RUNTIME")
if mode:
    runtime = ctypes.CDLL(os.environ["FAKE_CUDART_PATH"],
                          mode=ctypes.RTLD_GLOBAL if mode == "global" else ctypes.RTLD_LOCAL)
    p = ctypes.c_void_p()
    runtime.cudaMalloc(ctypes.byref(p), 4096)   # through the handle: the shim sees nothing
if os.environ.get("CALL"):
    ctypes.CDLL(None).cudaFree(None)
print("done")
"""


@pytest.mark.parametrize("variables, said", [
    ({"LIBCUDA": "copy"}, "without a shared CUDA runtime"),
    # A shared runtime loaded in any scope: calls through the loader reach the shim, so
    # none came for another reason the shim cannot tell (review finding).
    ({"LIBCUDA": "copy", "RUNTIME": "local"}, None),
    ({"LIBCUDA": "copy", "RUNTIME": "global"}, None),
    ({"LIBCUDA": "copy", "CALL": "1", "TIDEPOOL_CUDART": FAKE_CUDART}, None),
    ({"LIBCUDA": "copy", "TIDEPOOL_ALLOC_CONF": "tidepool.log:off"}, None),
    ({}, None),
    # Note [PyTorch's expandable segments under the shim]: said in a process with PyTorch's
    # CUDA library, whatever reached the shim; not without it, nor with the key False.
    ({"LIBCUDA": "copy", "LIBC10_CUDA": "copy", "CALL": "1", "TIDEPOOL_CUDART": FAKE_CUDART,
      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, "expandable_segments:True"),
    ({"LIBCUDA": "copy", "CALL": "1", "TIDEPOOL_CUDART": FAKE_CUDART,
      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, None),
    ({"LIBCUDA": "copy", "LIBC10_CUDA": "copy", "CALL": "1", "TIDEPOOL_CUDART": FAKE_CUDART,
      "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}, None),
], ids=["static-runtime", "local-runtime", "global-runtime", "a-call-came", "log-off",
        "no-cuda", "pytorch-expandable", "expandable-without-pytorch", "expandable-off"])
def test_the_shim_says_at_exit_when_no_cuda_call_could_reach_it(run_python, tmp_path,
                                                                 variables, said):
    if not os.path.isfile(FAKE_LIBCUDA):
        pytest.skip("fake libcuda not built")
    env = {"FAKE_CUDART_PATH": FAKE_CUDART, **variables}
    for variable, name in (("LIBCUDA", "libcuda.so.1"), ("LIBC10_CUDA", "libc10_cuda.so")):
        if variable in env:
            env[variable] = str(tmp_path / name)
            shutil.copy(FAKE_LIBCUDA, env[variable])
    result = run_python(EXIT_PROGRAM, preload=PRELOAD, **env)
    assert result.stdout.strip() == "done"
    if said is None:
        assert "tidepool preload" not in result.stderr, result.stderr
    else:
        assert result.stderr.count("tidepool preload") == 1, result.stderr
        assert said in result.stderr and "tidepool served none" in result.stderr


PEER_ACCESS = """
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 1 << 20)   # device 0's memory; sets tidepool up
lib = ctypes.CDLL(None)   # libtidepool, in the global scope once the shim set it up
fake.cudaSetDevice(1)     # not interposed: the runtime's own
out["rc"] = process.cudaDeviceEnablePeerAccess(0, 0)   # device 1 may read device 0's memory
out["again_rc"] = process.cudaDeviceEnablePeerAccess(0, 0)
out["last_error"] = process.cudaGetLastError()          # the runtime's answer to the second
out["calls"] = counter("fake_cudart_peer_access_calls")
out["granted"] = lib.tidepool_peer_access_enabled(0, 1)
out["not_the_other_way"] = lib.tidepool_peer_access_enabled(1, 0)
out["refused_rc"] = process.cudaDeviceEnablePeerAccess(2, 1)   # flags the runtime refuses
out["still_not"] = lib.tidepool_peer_access_enabled(2, 1)      # so tidepool grants nothing
fake.cudaSetDevice(2)
out["ahead_rc"] = process.cudaDeviceEnablePeerAccess(3, 0)   # device 3: no memory of it yet
out["granted_ahead"] = lib.tidepool_peer_access_enabled(3, 2)
fake.cudaSetDevice(0)
out["free_rc"] = process.cudaFree(p)
"""


def test_peer_access_the_program_enables_reaches_tidepools_memory(run_python):
    """Note [peer access under the shim] in preload/watched_calls.cpp: cudaDeviceEnable-
    PeerAccess covers cudaMalloc memory, not the memory tidepool maps (review finding: a
    kernel on the peer reading it faulted). The shim grants tidepool's too: for a device it
    holds memory of, and ahead for one it does not (tidepool remembers it for its
    mappings)."""
    out, stderr = run_with_fake(run_python, PEER_ACCESS, global_scope=True,
                                TIDEPOOL_BACKEND="host")
    assert out == {"malloc_rc": 0, "rc": 0, "again_rc": 704, "last_error": 704, "calls": 2,
                   "granted": 1, "not_the_other_way": 0, "refused_rc": 1, "still_not": 0,
                   "ahead_rc": 0, "granted_ahead": 1, "free_rc": 0}
    assert "could not give" not in stderr


MEM_GET_INFO = """
import tidepool
process.cudaMemGetInfo.argtypes = [c_void_p, c_void_p]
free, total = ctypes.c_size_t(), ctypes.c_size_t()
def mem_get_info():
    rc = process.cudaMemGetInfo(byref(free), byref(total))
    return [rc, free.value >> 20, total.value >> 20]
out["before_setup"] = mem_get_info()
p, q = c_void_p(), c_void_p()
process.cudaMalloc(byref(p), 64 << 20)
process.cudaMalloc(byref(q), 16 << 20)
out["in_use"] = mem_get_info()
process.cudaFree(p)                           # cached by tidepool: free again, as without it
out["cached"] = tidepool.stats(0)["reserved_bytes.all.current"] - \\
    tidepool.stats(0)["allocated_bytes.all.current"] >= 64 << 20
out["after_free"] = mem_get_info()
os.environ["FAKE_CUDART_DEVICE"] = "2"        # a device tidepool never served
out["other_device"] = mem_get_info()
os.environ["FAKE_CUDART_DEVICE"] = "0"
os.environ["FAKE_CUDART_FREE_MIB"] = "4090"   # never more than total
out["capped"] = mem_get_info()
out["null_rc"] = process.cudaMemGetInfo(None, byref(total))
out["last_error"] = process.cudaGetLastError()
out["calls"] = counter("fake_cudart_mem_get_info_calls")
process.cudaFree(q)
"""


def test_mem_get_info_counts_tidepools_cache_as_free(run_python):
    # Review finding: memory freed through cudaFree stayed in tidepool's cache and
    # cudaMemGetInfo counted it used, where without the shim it is free again: programs
    # sizing their buffers by it took less, or refused to start.
    out, stderr = run_with_fake(run_python, MEM_GET_INFO, TIDEPOOL_BACKEND="host")
    cached = out.pop("after_free")[1] - 1024
    assert 64 <= cached < 100, cached           # the freed block, and the rest of its slot
    assert out == {"before_setup": [0, 1024, 4096], "in_use": [0, 1024 + (cached - 64), 4096],
                   "cached": True, "other_device": [0, 1024, 4096], "capped": [0, 4096, 4096],
                   "null_rc": 1, "last_error": 1, "calls": 6}
    assert stderr == ""
