"""The LD_PRELOAD shim and the runtime's per-thread last error (Note [last error] in
preload/tidepool_preload.cpp), against the stand-in libcudart (fake_cudart.c), which keeps
a last error as the runtime does: what cudaGetLastError / cudaPeekAtLastError say after
the calls the shim serves must be what they would say without the shim."""

from __future__ import annotations

from preload_fake import needs_fake, needs_preload, run_with_fake

pytestmark = [needs_preload, needs_fake]

LAST_ERROR_PRELUDE = """
tp_ready = c_void_p()
process.cudaMalloc(byref(tp_ready), 4 << 20)   # tidepool is set up
fake.cudaSetDevice.argtypes = [ctypes.c_int]
def last_errors():   # what the program reads: peek, then get, then get again
    return [process.cudaPeekAtLastError(), process.cudaGetLastError(),
            process.cudaGetLastError()]
"""


def test_errors_the_shim_answers_are_the_programs_last_error(run_python):
    # The runtime never sees tidepool's out-of-memory or a size beyond tidepool's limit:
    # without the shim's own record, cudaGetLastError said cudaSuccess after them.
    out, _ = run_with_fake(run_python, LAST_ERROR_PRELUDE + """
p = c_void_p()
out["oom_rc"] = process.cudaMalloc(byref(p), 1 << 45)   # more than the host backend's 8 GiB
out["after_oom"] = last_errors()
out["beyond_limit_rc"] = process.cudaMallocAsync(byref(p), (1 << 50) + 1, None)
out["after_beyond_limit"] = last_errors()
# A later error of the runtime's is the newer one; a success changes nothing.
process.cudaMalloc(byref(p), 1 << 45)
out["set_device_rc"] = fake.cudaSetDevice(99)
out["after_runtime_error"] = last_errors()
process.cudaMalloc(byref(p), 1 << 45)
out["ok_rc"] = process.cudaMalloc(byref(p), 4096)
out["after_success"] = last_errors()
# A NULL devPtr: the runtime's own answer.
out["null_rc"] = process.cudaMalloc(None, 16)
out["after_null"] = last_errors()
""", TIDEPOOL_BACKEND="host")
    assert out == {"oom_rc": 2, "after_oom": [2, 2, 0],  # cudaErrorMemoryAllocation
                   "beyond_limit_rc": 2, "after_beyond_limit": [2, 2, 0],
                   "set_device_rc": 101, "after_runtime_error": [101, 101, 0],
                   "ok_rc": 0, "after_success": [2, 2, 0],
                   "null_rc": 1, "after_null": [1, 1, 0]}  # cudaErrorInvalidValue


def test_the_shims_own_calls_leave_the_programs_last_error_alone(run_python):
    # Without the host-streams helper the fake's events fail (cudaErrorNotSupported): from
    # the 64th free in the legacy stream's order on, each such free tries to record a fence
    # and cannot, which the shim handles (the ranges stay pending). The frees succeed: the
    # program's last error must neither become that failure nor lose its own pending one.
    out, _ = run_with_fake(run_python, LAST_ERROR_PRELUDE + """
p = c_void_p()
rcs = set()
for _ in range(64):
    rcs.add(process.cudaMallocAsync(byref(p), 4096, None))
    rcs.add(process.cudaFreeAsync(p, None))
out["rcs"] = sorted(rcs)
out["fences_tried"] = counter("fake_cudart_event_creates")
out["after_frees"] = last_errors()
out["set_device_rc"] = fake.cudaSetDevice(99)   # the program's own error, not read yet
process.cudaMallocAsync(byref(p), 4096, None)
out["free_rc"] = process.cudaFreeAsync(p, None)
out["pending_kept"] = last_errors()
""", TIDEPOOL_BACKEND="host")
    assert out == {"rcs": [0], "fences_tried": 1, "after_frees": [0, 0, 0],
                   "set_device_rc": 101, "free_rc": 0,
                   "pending_kept": [101, 101, 0]}  # cudaErrorInvalidDevice
