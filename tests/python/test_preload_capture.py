"""Calls the LD_PRELOAD shim must not serve as it serves the others
(preload/tidepool_preload.cpp), against the stand-in libcudart (fake_cudart.c): a
cudaFreeAsync of the shim's memory on a stream being captured into a CUDA graph (Note
[frees during capture]), and a cudaFree whose device synchronisation failed, where the
runtime would leave the memory allocated but the shim gave it to tidepool, which handed it
out again while kernels could still use it; and cudaIpcGetMemHandle of tidepool's memory
(Note [IPC of tidepool's memory]), which exported other bytes than the block's."""

from __future__ import annotations

from preload_fake import needs_fake, needs_preload, run_with_fake

pytestmark = [needs_preload, needs_fake]


def test_a_free_on_a_capturing_stream_is_refused_and_the_memory_stays(run_python):
    out, stderr = run_with_fake(run_python, """
import tidepool
allocated = lambda: tidepool.stats(0)["allocated_bytes.all.current"]
p, q, r = c_void_p(), c_void_p(), c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 1 << 20)
os.environ["FAKE_CUDART_CAPTURING"] = "1"
out["free_in_capture_rc"] = process.cudaFreeAsync(p, None)
out["again_rc"] = process.cudaFreeAsync(p, None)
out["last_error"] = process.cudaGetLastError()
out["allocated_in_capture"] = allocated()
out["runtime_free_asyncs"] = counter("fake_cudart_free_async_calls")
del os.environ["FAKE_CUDART_CAPTURING"]
process.cudaMalloc(byref(q), 1 << 20)
out["handed_out_again"] = q.value == p.value
out["free_after_capture_rc"] = process.cudaFreeAsync(p, None)
out["free_q_rc"] = process.cudaFree(q)
out["allocated_after"] = allocated()
""", TIDEPOOL_BACKEND="host")
    assert out == {"malloc_rc": 0, "free_in_capture_rc": 1, "again_rc": 1,  # InvalidValue
                   "last_error": 1, "allocated_in_capture": 1 << 20,
                   "runtime_free_asyncs": 0, "handed_out_again": False,
                   "free_after_capture_rc": 0, "free_q_rc": 0, "allocated_after": 0}
    said = [line for line in stderr.splitlines() if "being captured" in line]
    assert len(said) == 1, stderr


def test_a_cuda_free_whose_synchronisation_failed_leaves_the_memory_allocated(run_python):
    out, _ = run_with_fake(run_python, """
import tidepool
allocated = lambda: tidepool.stats(0)["allocated_bytes.all.current"]
p, q = c_void_p(), c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 1 << 20)
os.environ["FAKE_CUDART_SYNC_ERROR"] = "900"   # cudaErrorStreamCaptureUnsupported
out["free_rc"] = process.cudaFree(p)
out["allocated_after_failed_free"] = allocated()
del os.environ["FAKE_CUDART_SYNC_ERROR"]
out["last_error"] = process.cudaGetLastError()
process.cudaMalloc(byref(q), 1 << 20)
out["handed_out_again"] = q.value == p.value
out["free_again_rc"] = process.cudaFree(p)
out["free_q_rc"] = process.cudaFree(q)
out["allocated_after"] = allocated()
""", TIDEPOOL_BACKEND="host")
    assert out == {"malloc_rc": 0, "free_rc": 900, "allocated_after_failed_free": 1 << 20,
                   "last_error": 900, "handed_out_again": False, "free_again_rc": 0,
                   "free_q_rc": 0, "allocated_after": 0}


def test_an_ipc_export_of_tidepool_memory_is_refused_and_others_are_forwarded(run_python):
    # Note [IPC of tidepool's memory]: the runtime would export the whole segment around the
    # block, and the importer would map other bytes than the block's.
    out, stderr = run_with_fake(run_python, """
process.cudaIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
handle = ctypes.create_string_buffer(64)
p, q = c_void_p(), c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 1 << 20)
out["tidepool_export_rc"] = process.cudaIpcGetMemHandle(handle, p)
out["interior_export_rc"] = process.cudaIpcGetMemHandle(handle, p.value + 4096)
out["last_error"] = process.cudaGetLastError()
fake.cudaMalloc(byref(q), ctypes.c_size_t(64))   # memory tidepool never saw
out["foreign_export_rc"] = process.cudaIpcGetMemHandle(handle, q)
out["runtime_exports"] = counter("fake_cudart_ipc_exports")
out["free_rc"] = process.cudaFree(p)
""", TIDEPOOL_BACKEND="host")
    assert out == {"malloc_rc": 0, "tidepool_export_rc": 1, "interior_export_rc": 1,
                   "last_error": 1, "foreign_export_rc": 0, "runtime_exports": 1,
                   "free_rc": 0}
    said = [line for line in stderr.splitlines() if "CUDA IPC of memory tidepool serves" in line]
    assert len(said) == 1, stderr


def test_after_a_device_reset_tidepool_no_longer_serves_that_device(run_python):
    # Note [cudaDeviceReset under the shim]: memory tidepool cached before the reset would
    # be handed out again over the new context.
    out, stderr = run_with_fake(run_python, """
import tidepool
stats = lambda: tidepool.stats(0)
process.cudaDeviceReset.argtypes = []
p, q, r = c_void_p(), c_void_p(), c_void_p()
process.cudaMalloc(byref(p), 64 << 20)    # a segment of its own
process.cudaMalloc(byref(q), 2 << 20)     # live across the reset
process.cudaFree(p)                       # cached by tidepool
reserved_before = stats()["reserved_bytes.all.current"]
out["reset_rc"] = process.cudaDeviceReset()
out["runtime_resets"] = counter("fake_cudart_resets")
out["cache_given_back"] = reserved_before - stats()["reserved_bytes.all.current"] >= 64 << 20
out["malloc_rc"] = process.cudaMalloc(byref(r), 64 << 20)
out["runtime_mallocs"] = counter("fake_cudart_malloc_calls")
out["got_the_old_block"] = r.value == p.value
out["free_rc"] = process.cudaFree(r)
out["runtime_frees"] = counter("fake_cudart_free_calls")
out["free_from_before_rc"] = process.cudaFree(q)
out["reset_again_rc"] = process.cudaDeviceReset()
""", TIDEPOOL_BACKEND="host")
    assert out == {"reset_rc": 0, "runtime_resets": 1, "cache_given_back": True,
                   "malloc_rc": 0, "runtime_mallocs": 1,
                   "got_the_old_block": False, "free_rc": 0, "runtime_frees": 1,
                   "free_from_before_rc": 1, "reset_again_rc": 0}
    said = [line for line in stderr.splitlines() if "cudaDeviceReset" in line]
    assert len(said) == 1, stderr
    assert "no longer serves device 0" in said[0] and str(2 << 20) in said[0]


def test_after_a_device_reset_its_old_addresses_are_the_runtimes(run_python):
    # Note [cudaDeviceReset under the shim]: tidepool keeps the ranges of the reset device's
    # segments it could not give back (here q's), and the new context may hand those
    # addresses out again (FAKE_CUDART_MALLOC_AT). Such an allocation is the runtime's: its
    # free and export were refused as tidepool's memory (a leak). Another device's memory
    # still counts. A stream of the reset device is not released in tidepool: the release
    # waited for a stream that died with the context (the host backend does not know the
    # fake's handle, so it failed, as on a GPU).
    out, stderr = run_with_fake(run_python, """
lib = ctypes.CDLL(os.environ["TIDEPOOL_LIBRARY"])
lib.tidepool_holds_address.argtypes = [ctypes.c_void_p]
process.cudaDeviceReset.argtypes = []
process.cudaIpcGetMemHandle.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
handle = ctypes.create_string_buffer(64)
q, r, a, other = c_void_p(), c_void_p(), c_void_p(), c_void_p()
os.environ["FAKE_CUDART_DEVICE"] = "1"
process.cudaMalloc(byref(other), 1 << 20)   # device 1's, not reset
os.environ["FAKE_CUDART_DEVICE"] = "0"
s = c_void_p()
fake.cudaStreamCreate(byref(s))
process.cudaMalloc(byref(q), 2 << 20)       # live across the reset: its segment stays
process.cudaMallocAsync(byref(a), 4096, s)  # tidepool holds memory for s, live too
out["reset_rc"] = process.cudaDeviceReset()
out["tidepool_still_holds"] = lib.tidepool_holds_address(q)   # in its bookkeeping
os.environ["FAKE_CUDART_MALLOC_AT"] = str(q.value + 4096)
out["malloc_rc"] = process.cudaMalloc(byref(r), 4096)
out["in_the_old_segment"] = r.value == q.value + 4096
out["export_rc"] = process.cudaIpcGetMemHandle(handle, r)
out["runtime_exports"] = counter("fake_cudart_ipc_exports")
out["free_rc"] = process.cudaFree(r)
out["runtime_frees"] = counter("fake_cudart_free_calls")
out["other_device_interior_free_rc"] = process.cudaFree(c_void_p(other.value + 4096))
out["other_device_export_rc"] = process.cudaIpcGetMemHandle(handle, other)
out["runtime_frees_after"] = counter("fake_cudart_free_calls")
out["destroy_rc"] = process.cudaStreamDestroy(s)
out["runtime_destroys"] = counter("fake_cudart_stream_destroy_calls")
""", TIDEPOOL_BACKEND="host")
    assert out == {"reset_rc": 0, "tidepool_still_holds": 1, "malloc_rc": 0,
                   "in_the_old_segment": True, "export_rc": 0, "runtime_exports": 1,
                   "free_rc": 0, "runtime_frees": 1,
                   "other_device_interior_free_rc": 1, "other_device_export_rc": 1,
                   "runtime_frees_after": 1, "destroy_rc": 0, "runtime_destroys": 1}
    assert "could not release" not in stderr, stderr
