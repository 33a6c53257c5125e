"""The LD_PRELOAD shim and the two default streams, against the stand-in libcudart
(fake_cudart.c) with the host-streams helper: programs built with --default-stream
per-thread (the _ptsz calls), and cudaMalloc after frees in the legacy stream's order."""

from __future__ import annotations

from preload_fake import (HOST_STREAMS, STREAMS_PRELUDE, needs_fake, needs_host_streams,
                          needs_preload, run_with_fake)

pytestmark = [needs_preload, needs_fake, needs_host_streams]


# Note [per-thread default stream programs] in preload/tidepool_preload.cpp: a program built
# with --default-stream per-thread calls the _ptsz forms, where stream 0 is its thread's
# per-thread stream.


def test_per_thread_default_stream_calls_are_served_and_forwarded(run_python):
    out, stderr = run_with_fake(run_python, STREAMS_PRELUDE + """
bind_ptsz()
allocated = lambda: tidepool.stats(0)["allocated_bytes.all.current"] - (4 << 20)
p = c_void_p()
out["malloc_rc"] = process.cudaMallocAsync_ptsz(byref(p), LARGE, None)
out["allocated"] = allocated()
out["streams"] = sorted({seg["stream"] for seg in tidepool.snapshot(0)["segments"]})
out["free_rc"] = process.cudaFreeAsync_ptsz(p, None)
out["allocated_after_free"] = allocated()
# cudaFreeAsync_ptsz frees cudaMalloc's memory too: tidepool's, never the runtime's.
q = c_void_p()
process.cudaMalloc(byref(q), 4096)
out["free_of_malloc_rc"] = process.cudaFreeAsync_ptsz(q, None)
out["allocated_at_end"] = allocated()
out["cuda_ptsz_calls"] = [counter("fake_cudart_malloc_async_ptsz_calls"),
                          counter("fake_cudart_free_async_ptsz_calls")]
# Memory tidepool never saw, and a 0-byte request: the runtime's _ptsz functions, given
# the program's own stream argument (0, which they read as per-thread themselves).
f = c_void_p()
fake.cudaMallocAsync_ptsz(byref(f), 64, None)
last_stream = lambda: ctypes.c_ssize_t.in_dll(fake, "fake_cudart_last_ptsz_stream").value
out["foreign_free_rc"] = process.cudaFreeAsync_ptsz(f, None)
out["foreign_free_stream"] = last_stream()
out["zero_rc"] = process.cudaMallocAsync_ptsz(byref(c_void_p()), 0, c_void_p(1))
out["zero_stream"] = last_stream()
out["cuda_ptsz_calls_after"] = [counter("fake_cudart_malloc_async_ptsz_calls"),
                                counter("fake_cudart_free_async_ptsz_calls")]
out["plain_calls"] = [counter("fake_cudart_malloc_async_calls"),
                      counter("fake_cudart_free_async_calls")]
settle(0)
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS)
    assert out == {"malloc_rc": 0, "allocated": 4 << 20, "streams": ["0x0"], "free_rc": 0,
                   "allocated_after_free": 0, "free_of_malloc_rc": 0, "allocated_at_end": 0,
                   "cuda_ptsz_calls": [0, 0], "foreign_free_rc": 0, "zero_rc": 0,
                   "foreign_free_stream": 0, "zero_stream": 1,
                   "cuda_ptsz_calls_after": [2, 1], "plain_calls": [0, 0]}
    assert stderr == ""


def test_per_thread_default_stream_zero_is_the_threads_own_stream(run_python):
    # A block freed with cudaFreeAsync_ptsz(p, 0) on a held per-thread stream is not the
    # legacy stream's to reuse at once (it would be if 0 meant the NULL stream there): it
    # waits until that thread's stream has passed the free.
    out, stderr = run_with_fake(run_python, STREAMS_PRELUDE + """
import threading
bind_ptsz()
def free_on_a_held_per_thread_stream():
    p = c_void_p()
    out["malloc_rc"] = process.cudaMallocAsync_ptsz(byref(p), LARGE, None)
    helper.host_streams_hold(c_void_p(2), 0)
    out["free_rc"] = process.cudaFreeAsync_ptsz(p, None)
    out["p"] = p.value
thread = threading.Thread(target=free_on_a_held_per_thread_stream)
thread.start()
thread.join()
def allocate():
    q = c_void_p()
    process.cudaMallocAsync_ptsz(byref(q), LARGE, c_void_p(1))   # the legacy stream
    return q.value
out["reused_while_held"] = allocate() == out["p"]
settle(0)
out["reused_once_passed"] = allocate() == out.pop("p")
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS)
    assert out == {"malloc_rc": 0, "free_rc": 0, "reused_while_held": False,
                   "reused_once_passed": True}
    assert stderr == ""


# Note [cudaMalloc after stream-ordered frees] in preload/legacy_frees.cpp. With
# FAKE_CUDART_SYNC_OPENS_GATE only a cudaStreamSynchronize lets a held stream pass.
LEGACY_FREES_PRELUDE = STREAMS_PRELUDE + """
fake.cudaEventCreateWithFlags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
fake.cudaEventRecord.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
fake.cudaEventQuery.argtypes = [ctypes.c_void_p]
waits = lambda: counter("fake_cudart_stream_synchronize_calls")
def legacy_work_using_memory():   # held back; an event says when the stream passes it
    helper.host_streams_hold(None, 0)
    passed = c_void_p()
    fake.cudaEventCreateWithFlags(byref(passed), 0)
    fake.cudaEventRecord(passed, None)
    return passed
"""


def test_cuda_malloc_waits_for_legacy_stream_frees_of_its_block(run_python):
    # A block freed with cudaFreeAsync(p, 0) is the legacy stream's to reuse at once, in
    # its order; a cudaMalloc, whose memory any stream may use at once, gets it only after
    # the legacy stream has passed the free.
    out, stderr = run_with_fake(run_python, LEGACY_FREES_PRELUDE + """
p = c_void_p()
process.cudaMallocAsync(byref(p), LARGE, None)
passed = legacy_work_using_memory()
out["free_rc"] = process.cudaFreeAsync(p, None)
q = c_void_p()
process.cudaMallocAsync(byref(q), LARGE, None)
out["reused_in_stream_order"] = q.value == p.value
process.cudaFreeAsync(q, None)
before = waits()
small = c_void_p()
out["small_rc"] = process.cudaMalloc(byref(small), 4096)   # overlaps no such free
out["waits_for_other_memory"] = waits() - before
r = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(r), LARGE)
out["reused"] = r.value == p.value
out["legacy_work_done_when_handed_out"] = fake.cudaEventQuery(passed) == 0
out["waits"] = waits() - before
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS, FAKE_CUDART_SYNC_OPENS_GATE="1")
    assert out == {"free_rc": 0, "reused_in_stream_order": True, "small_rc": 0,
                   "waits_for_other_memory": 0, "malloc_rc": 0, "reused": True,
                   "legacy_work_done_when_handed_out": True, "waits": 1}
    assert stderr == ""


def test_cuda_malloc_whose_wait_fails_gives_the_block_back(run_python):
    # The legacy stream's work failed: the wait answers the runtime's error, the cudaMalloc
    # fails with it and keeps nothing. The next cudaMalloc gets the block without a second
    # wait: the fence the first one recorded says the stream has passed the free.
    out, stderr = run_with_fake(run_python, LEGACY_FREES_PRELUDE + """
helper.host_streams_fail.argtypes = [ctypes.c_void_p, ctypes.c_int]
allocated = lambda: tidepool.stats(0)["allocated_bytes.all.current"] - (4 << 20)
p = c_void_p()
process.cudaMallocAsync(byref(p), LARGE, None)
legacy_work_using_memory()
helper.host_streams_fail(None, 0)
process.cudaFreeAsync(p, None)
r = c_void_p(1)
out["failed_rc"] = process.cudaMalloc(byref(r), LARGE)
out["failed_ptr"] = r.value
out["allocated"] = allocated()
out["malloc_rc"] = process.cudaMalloc(byref(r), LARGE)
out["reused"] = r.value == p.value
out["waits"] = waits()
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS, FAKE_CUDART_SYNC_OPENS_GATE="1")
    assert out == {"failed_rc": 719, "failed_ptr": None,  # cudaErrorLaunchFailure
                   "allocated": 0, "malloc_rc": 0, "reused": True, "waits": 1}
    assert stderr == ""


def test_cuda_malloc_does_not_wait_for_legacy_frees_known_passed(run_python):
    # Once enough such frees are pending the shim records a fence on the legacy stream; a
    # completed fence, or cudaFree's device synchronisation, says they have passed.
    out, stderr = run_with_fake(run_python, LEGACY_FREES_PRELUDE + """
p = c_void_p()
for _ in range(64):
    process.cudaMallocAsync(byref(p), LARGE, None)
    process.cudaFreeAsync(p, None)
helper.host_streams_synchronize_device(0)   # the fence has completed
before = waits()
r = c_void_p()
process.cudaMalloc(byref(r), LARGE)
out["reused"] = r.value == p.value
out["waits_after_fence"] = waits() - before
process.cudaFreeAsync(r, None)
passed = legacy_work_using_memory()
s = c_void_p()
process.cudaMalloc(byref(s), 4096)
out["free_rc"] = process.cudaFree(s)        # a device synchronisation (the fake's only counts)
helper.host_streams_open()                  # what that synchronisation waited for
out["synchronizes"] = counter("fake_cudart_synchronize_calls")
process.cudaMalloc(byref(r), LARGE)
out["reused_again"] = r.value == p.value
out["waits_after_cuda_free"] = waits() - before
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS)
    assert out == {"reused": True, "waits_after_fence": 0, "free_rc": 0, "synchronizes": 1,
                   "reused_again": True, "waits_after_cuda_free": 0}
    assert stderr == ""


def test_cuda_malloc_waits_for_legacy_frees_of_a_destroyed_streams_block(run_python):
    # Review finding: only blocks allocated on the NULL stream were noted when freed in the
    # legacy stream's order. A block of a stream the program had destroyed, freed with
    # cudaFreeAsync(p, 0), became the NULL stream's at once, and cudaMalloc handed it out
    # while legacy work before the free still used it.
    out, stderr = run_with_fake(run_python, LEGACY_FREES_PRELUDE + """
s = create_stream()
p = c_void_p()
out["malloc_async_rc"] = process.cudaMallocAsync(byref(p), LARGE, s)
out["destroy_rc"] = process.cudaStreamDestroy(s)
passed = legacy_work_using_memory()
out["free_rc"] = process.cudaFreeAsync(p, None)
before = waits()
r = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(r), LARGE)
out["reused"] = r.value == p.value
out["legacy_work_done_when_handed_out"] = fake.cudaEventQuery(passed) == 0
out["waits"] = waits() - before
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS, FAKE_CUDART_SYNC_OPENS_GATE="1")
    assert out == {"malloc_async_rc": 0, "destroy_rc": 0, "free_rc": 0, "malloc_rc": 0,
                   "reused": True, "legacy_work_done_when_handed_out": True, "waits": 1}
    assert stderr == ""


def test_a_cuda_error_inside_tidepool_is_the_programs_answer(run_python):
    # Note [errors keep CUDA's meaning] in preload/tidepool_preload.cpp: a cudaMalloc that
    # failed in a CUDA call inside tidepool (a kernel faulted: the driver's next call
    # answers cudaErrorIllegalAddress) answers that error, as the runtime would, not
    # cudaErrorInvalidValue; a bad request still answers cudaErrorInvalidValue.
    out, stderr = run_with_fake(run_python, STREAMS_PRELUDE + """
helper.host_streams_fail_next_map.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int]
helper.host_streams_fail_next_map(0, 1, 700)
p = c_void_p()
out["rc"] = process.cudaMalloc(byref(p), 64 << 20)
out["last_error"] = process.cudaGetLastError()
out["ptr"] = p.value
out["again_rc"] = process.cudaMalloc(byref(p), 64 << 20)   # the fault was once
out["free_rc"] = process.cudaFree(p)
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS)
    assert out == {"rc": 700, "last_error": 700, "ptr": None, "again_rc": 0, "free_rc": 0}
    assert "injected fault" in stderr   # libtidepool says what failed
