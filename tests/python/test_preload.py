"""libtidepool_preload.so at process start-up (LD_PRELOAD): it claims the same keys with
the same parser before the program runs, stops on a bad key, and leaves programs alone
otherwise. Routing, forwarding and error codes are checked against a stand-in libcudart
(fake_cudart.c); routing on a real GPU: scripts/gpu_e2e_llama.py."""

from __future__ import annotations

import os

import pytest

PRELOAD = os.environ.get("TIDEPOOL_PRELOAD_LIBRARY", "")

pytestmark = pytest.mark.skipif(not os.path.isfile(PRELOAD),
                                reason="TIDEPOOL_PRELOAD_LIBRARY not built (a build without CUDA)")

SHOW_ENV = """
import os, sys
import tidepool
print(repr(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")), any(
    type(f).__name__ == "_TorchImportFinder" for f in sys.meta_path))
print(tidepool.status())
"""


def test_keys_are_claimed_before_the_program_starts(run_python):
    result = run_python(SHOW_ENV, preload=PRELOAD,
                        PYTORCH_CUDA_ALLOC_CONF="backend:tidepool,expandable_segments:True,"
                                                "tidepool.log:info")
    # Rewritten before Python started; the Python hook stands aside (no import finder):
    # PyTorch keeps its allocator, whose cudaMalloc calls the shim serves.
    lines = result.stdout.strip().splitlines()
    assert lines[0].split() == ["'expandable_segments:True'", "False"]
    assert lines[1] == "active: through the LD_PRELOAD shim (libtidepool_preload.so)"
    assert result.stderr.startswith('tidepool preload: active: {"enabled":true,"mode":"global",')


def test_a_bad_key_stops_the_program_with_the_parser_message(run_python):
    result = run_python("print('should not run')", check=False, preload=PRELOAD,
                        PYTORCH_CUDA_ALLOC_CONF="backend:tidepool,tidepool.pinned_budget:much")
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.strip().startswith(
        "tidepool preload: PYTORCH_CUDA_ALLOC_CONF: tidepool.pinned_budget: 'much' is not a valid "
        "value; allowed:")


def test_without_tidepool_keys_the_environment_is_untouched(run_python):
    result = run_python(SHOW_ENV, preload=PRELOAD, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64")
    assert result.stdout.strip().splitlines()[0].split() == ["'max_split_size_mb:64'", "False"]
    assert result.stderr == ""


def test_pool_mode_is_explained(run_python):
    result = run_python(SHOW_ENV, preload=PRELOAD, PYTORCH_ALLOC_CONF="tidepool.mode:pool")
    assert "tidepool.mode:pool needs the Python package" in result.stderr


FAKE_CUDART = os.environ.get("TIDEPOOL_TEST_FAKE_CUDART", "")

ROUTING = """
import ctypes, json, os
import tidepool
c_void_p, byref = ctypes.c_void_p, ctypes.byref
process = ctypes.CDLL(None)            # cudaMalloc/cudaFree as any program resolves them
fake = ctypes.CDLL(os.environ["TIDEPOOL_CUDART"])
counter = lambda name: ctypes.c_int.in_dll(fake, name).value
process.cudaMalloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
process.cudaFree.argtypes = [ctypes.c_void_p]
out = {}
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 1 << 20)
out["allocated_after_malloc"] = tidepool.stats(0)["allocated_bytes.all.current"]
out["cuda_mallocs"] = counter("fake_cudart_malloc_calls")
out["free_rc"] = process.cudaFree(p)
out["allocated_after_free"] = tidepool.stats(0)["allocated_bytes.all.current"]
out["synchronizes"] = counter("fake_cudart_synchronize_calls")
out["cuda_frees_after_own_free"] = counter("fake_cudart_free_calls")
q = c_void_p()
fake.cudaMalloc(byref(q), ctypes.c_size_t(64))   # memory tidepool never saw
out["foreign_free_rc"] = process.cudaFree(q)
out["cuda_frees_after_foreign_free"] = counter("fake_cudart_free_calls")
z = c_void_p(1)
out["zero_rc"] = process.cudaMalloc(byref(z), 0)
out["zero_ptr"] = z.value
out["null_out_rc"] = process.cudaMalloc(None, 16)
print(json.dumps(out))
"""


@pytest.mark.skipif(not os.path.isfile(FAKE_CUDART), reason="fake libcudart not built")
@pytest.mark.parametrize("variables", [
    # Named: set up before the program starts.
    {"PYTORCH_CUDA_ALLOC_CONF": "tidepool.device_backend:host"},
    # Not named: set up at the first cudaMalloc (host backend chosen the allocator's way).
    {"TIDEPOOL_BACKEND": "host"},
], ids=["configured-at-start", "configured-at-first-cudaMalloc"])
def test_cuda_malloc_and_free_are_routed_through_tidepool(run_python, variables):
    import json
    result = run_python(ROUTING, preload=PRELOAD, TIDEPOOL_CUDART=FAKE_CUDART, **variables)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {
        "malloc_rc": 0, "allocated_after_malloc": 1 << 20, "cuda_mallocs": 0,
        # cudaFree's promise kept: the device is synchronised before the memory is reused.
        "free_rc": 0, "allocated_after_free": 0, "synchronizes": 1, "cuda_frees_after_own_free": 0,
        "foreign_free_rc": 0, "cuda_frees_after_foreign_free": 1,
        "zero_rc": 0, "zero_ptr": None, "null_out_rc": 1,  # cudaErrorInvalidValue
    }


# The checks below run in a fresh interpreter with the shim preloaded and the fake libcudart
# as "CUDA"; each prints one JSON line. PRELUDE binds the process's cudaMalloc/cudaFree (the
# shim's) and the fake's counters. The fake is found through TIDEPOOL_CUDART unless a test
# loads it into the global scope itself (FAKE_GLOBAL=1), as a program linked against its
# runtime has it.
PRELUDE = """
import ctypes, json, os
c_void_p, byref = ctypes.c_void_p, ctypes.byref
fake_path = os.environ["FAKE_CUDART_PATH"]
fake = ctypes.CDLL(fake_path, mode=ctypes.RTLD_GLOBAL if os.environ.get("FAKE_GLOBAL") else 0)
process = ctypes.CDLL(None)
process.cudaMalloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
process.cudaFree.argtypes = [ctypes.c_void_p]
counter = lambda name: ctypes.c_int.in_dll(fake, name).value
out = {}
"""


def run_with_fake(run_python, code, *, global_scope=False, **variables):
    import json
    env = {"FAKE_CUDART_PATH": FAKE_CUDART, **variables}
    if global_scope:
        env["FAKE_GLOBAL"] = "1"
    else:
        env["TIDEPOOL_CUDART"] = FAKE_CUDART
    result = run_python(PRELUDE + code + "\nprint(json.dumps(out))\n", preload=PRELOAD, **env)
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


needs_fake = pytest.mark.skipif(not os.path.isfile(FAKE_CUDART), reason="fake libcudart not built")


@needs_fake
def test_cuda_free_null_as_the_first_call_reaches_cuda(run_python):
    # Lazy set-up (the environment does not name tidepool): cudaFree(NULL), the usual
    # "create the context" call, comes before any cudaMalloc and must reach the runtime
    # rather than fail with cudaErrorInitializationError.
    out, _ = run_with_fake(run_python, """
out["free_null_rc"] = process.cudaFree(None)
out["cuda_frees"] = counter("fake_cudart_free_calls")
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 4096)
out["cuda_mallocs"] = counter("fake_cudart_malloc_calls")   # 0: tidepool served it
out["free_rc"] = process.cudaFree(p)
""", TIDEPOOL_BACKEND="host")
    assert out == {"free_null_rc": 0, "cuda_frees": 1, "malloc_rc": 0, "cuda_mallocs": 0,
                   "free_rc": 0}


FORWARD_ALL = """
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 4096)
out["malloc_rc_2"] = process.cudaMalloc(byref(c_void_p()), 4096)
out["cuda_mallocs"] = counter("fake_cudart_malloc_calls")
out["free_rc"] = process.cudaFree(p)
out["cuda_frees"] = counter("fake_cudart_free_calls")
out["synchronizes"] = counter("fake_cudart_synchronize_calls")
"""


@needs_fake
@pytest.mark.parametrize("global_scope", [False, True], ids=["found-by-search", "program's-own"])
def test_another_cuda_major_is_forwarded_untouched(run_python, global_scope):
    # A CUDA 12 program that inherited LD_PRELOAD: tidepool (built for another major) stays
    # out of it, every call reaches the program's runtime, and the shim says so once.
    out, stderr = run_with_fake(run_python, FORWARD_ALL, global_scope=global_scope,
                                FAKE_CUDART_VERSION="12080", TIDEPOOL_BACKEND="host")
    assert out == {"malloc_rc": 0, "malloc_rc_2": 0, "cuda_mallocs": 2, "free_rc": 0,
                   "cuda_frees": 1, "synchronizes": 0}
    assert stderr.count("tidepool preload:") == 1
    assert "is version 12.8, but tidepool was built for CUDA" in stderr
    assert "tidepool is off: every cudaMalloc/cudaFree goes to that runtime unchanged" in stderr


@needs_fake
def test_another_cuda_major_is_quiet_under_log_off(run_python):
    out, stderr = run_with_fake(run_python, FORWARD_ALL, FAKE_CUDART_VERSION="12080",
                                PYTORCH_CUDA_ALLOC_CONF="tidepool.log:off")
    assert out["cuda_mallocs"] == 2
    assert stderr == ""


@needs_fake
def test_the_programs_own_runtime_is_the_forwarding_target(run_python):
    # The runtime already in the global scope (found with dlsym(RTLD_NEXT)) is the one the
    # shim forwards to, with no TIDEPOOL_CUDART to point at it; of tidepool's major, tidepool
    # serves the allocations.
    out, stderr = run_with_fake(run_python, """
import tidepool
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 1 << 20)
out["allocated"] = tidepool.stats(0)["allocated_bytes.all.current"]
out["cuda_mallocs"] = counter("fake_cudart_malloc_calls")
out["free_rc"] = process.cudaFree(p)
out["synchronizes"] = counter("fake_cudart_synchronize_calls")
q = c_void_p()
fake.cudaMalloc(byref(q), ctypes.c_size_t(64))
out["foreign_free_rc"] = process.cudaFree(q)
out["cuda_frees"] = counter("fake_cudart_free_calls")
""", global_scope=True, TIDEPOOL_BACKEND="host")
    assert out == {"malloc_rc": 0, "allocated": 1 << 20, "cuda_mallocs": 0, "free_rc": 0,
                   "synchronizes": 1, "foreign_free_rc": 0, "cuda_frees": 1}
    assert stderr == ""


@needs_fake
def test_error_codes_keep_their_cuda_meaning(run_python):
    out, stderr = run_with_fake(run_python, """
p = c_void_p(1)
out["too_big_rc"] = process.cudaMalloc(byref(p), 1 << 45)   # more than the host backend's 8 GiB
out["too_big_ptr"] = p.value
# Sizes tidepool calls implausible (above 2^50, or a negative one cast): a bad request.
out["implausible_rc"] = process.cudaMalloc(byref(p), 1 << 62)
out["negative_rc"] = process.cudaMalloc(byref(p), (1 << 64) - 1)
# A pointer tidepool no longer owns (freed behind the shim's back): an invalid free.
out["malloc_rc"] = process.cudaMalloc(byref(p), 4096)
# The copy the shim loaded (only now: loaded first, its libcudart would be "CUDA").
tp = ctypes.CDLL(os.environ["TIDEPOOL_LIBRARY"])
tp.tidepool_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
tp.tidepool_free(p, 4096, 0, None)
out["stale_free_rc"] = process.cudaFree(p)
# A device tidepool cannot serve: a bad request, not out-of-memory.
os.environ["FAKE_CUDART_DEVICE"] = "4096"
out["bad_device_rc"] = process.cudaMalloc(byref(p), 4096)
""", TIDEPOOL_BACKEND="host")
    assert out == {"too_big_rc": 2, "too_big_ptr": None,  # cudaErrorMemoryAllocation
                   "implausible_rc": 1, "negative_rc": 1, "malloc_rc": 0,  # cudaErrorInvalidValue
                   "stale_free_rc": 1, "bad_device_rc": 1}
    assert "tidepool preload: cudaMalloc: tidepool: out of memory" in stderr
    assert "is not a plausible size" in stderr  # libtidepool's own message for a bad request


@needs_fake
def test_a_nested_forwarded_call_leaves_the_outer_one_inside(run_python):
    # While the shim forwards a cudaFree, the runtime makes nested calls (the fake does:
    # cudaFree(NULL), then cudaMalloc). The nested cudaMalloc must be forwarded too, not
    # served by tidepool: the end of the nested cudaFree must not clear the outer call's
    # "inside" mark (as it would inside tidepool_malloc on the cuda backend).
    out, _ = run_with_fake(run_python, """
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 4096)    # tidepool is set up
q = c_void_p()
fake.cudaMalloc(byref(q), ctypes.c_size_t(64))
os.environ["FAKE_CUDART_NEST"] = "1"
out["foreign_free_rc"] = process.cudaFree(q)
out["nested_forwarded"] = counter("fake_cudart_nested_forwarded")
""", TIDEPOOL_BACKEND="host")
    assert out == {"malloc_rc": 0, "foreign_free_rc": 0, "nested_forwarded": 1}
