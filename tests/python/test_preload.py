"""libtidepool_preload.so at process start-up (LD_PRELOAD): it claims the same keys with
the same parser before the program runs, stops on a bad key, and leaves programs alone
otherwise. cudaMalloc routing needs a GPU: scripts/gpu_e2e_llama.py checks that."""

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
