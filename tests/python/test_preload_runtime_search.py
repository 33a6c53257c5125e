"""Which CUDA runtime the LD_PRELOAD shim forwards to when the program's own is not in the
global scope (the search in preload/libraries.cpp, Note [a runtime found late]), against
the stand-in libcudart (fake_cudart.c) loaded RTLD_LOCAL, as Python loads an extension's
runtime: the program's calls must reach that runtime, never a second one the shim loads,
and never fail for want of one."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from conftest import clean_env
from preload_fake import FAKE_CUDART, PRELOAD, PRELUDE, needs_fake, needs_preload

pytestmark = [needs_preload, needs_fake]

# The program's calls (the shim's symbols), and what reached the fake.
CALLS = """
p, q = c_void_p(), c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 1 << 20)
out["fake_mallocs"] = counter("fake_cudart_malloc_calls")
fake.cudaMalloc(byref(q), ctypes.c_size_t(64))   # memory tidepool never saw
out["foreign_free_rc"] = process.cudaFree(q)
out["fake_frees"] = counter("fake_cudart_free_calls")
out["last_error"] = process.cudaGetLastError()
"""


def test_a_runtime_loaded_in_a_local_scope_is_the_forwarding_target(run_python):
    # Set up at the first cudaMalloc, when the program has its runtime loaded, but not
    # where dlsym(RTLD_NEXT) finds it. Before, the shim loaded libcudart.so.<major> from
    # the loader's path beside it (or, with none there, failed every call), and the
    # program's frees of its own memory went to that second runtime.
    result = run_python(PRELUDE + CALLS + """
import tidepool
out["tidepool_allocated"] = tidepool.stats(0)["allocated_bytes.all.current"]
print(json.dumps(out))
""", preload=PRELOAD, FAKE_CUDART_PATH=FAKE_CUDART, TIDEPOOL_BACKEND="host")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"malloc_rc": 0, "fake_mallocs": 0,  # tidepool served it
                   "foreign_free_rc": 0, "fake_frees": 1, "last_error": 0,
                   "tidepool_allocated": 1 << 20}
    assert result.stderr == ""


def program_interpreter(executable: str) -> str | None:
    """The dynamic loader an ELF executable names (its PT_INTERP), or None."""
    with open(executable, "rb") as f:
        data = f.read(1 << 16)
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit ELF only
        return None
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    for i in range(phnum):
        p_type, _, p_offset, _, _, p_filesz = struct.unpack_from(
            "<IIQQQQ", data, phoff + i * phentsize)
        if p_type == 3:  # PT_INTERP
            return data[p_offset:p_offset + p_filesz].rstrip(b"\0").decode()
    return None


def test_a_runtime_loaded_after_a_set_up_that_found_none_gets_every_call():
    # The variables name tidepool, so the shim sets up before main, when a Python program
    # has no runtime loaded; the loader runs without its cache (--inhibit-cache) so that a
    # toolkit in ld.so.conf is not found either. Before, every forwarded call then answered
    # cudaErrorInitializationError for good: the program's CUDA did not work at all.
    loader = program_interpreter(os.path.realpath(sys.executable))
    if loader is None or not os.path.exists(loader):
        pytest.skip("no ELF interpreter to run the program under")
    env = clean_env(FAKE_CUDART_PATH=FAKE_CUDART,
                    PYTORCH_CUDA_ALLOC_CONF="tidepool.device_backend:host")
    for name in ("VIRTUAL_ENV", "CONDA_PREFIX"):
        env.pop(name, None)
    result = subprocess.run(
        [loader, "--inhibit-cache", "--preload", PRELOAD, sys.executable, "-c",
         PRELUDE + CALLS + "print(json.dumps(out))\n"],
        env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    if "cannot find libcudart" not in result.stderr:
        pytest.skip("a CUDA runtime is on the loader's default path: the set-up found one")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"malloc_rc": 0, "fake_mallocs": 1, "foreign_free_rc": 0, "fake_frees": 1,
                   "last_error": 0}
    said = [line for line in result.stderr.splitlines() if "after tidepool was set up" in line]
    assert len(said) == 1, result.stderr
    assert os.path.basename(FAKE_CUDART) in said[0] and "TIDEPOOL_CUDART" in said[0]


def test_the_late_runtime_is_not_said_under_log_off():
    loader = program_interpreter(os.path.realpath(sys.executable))
    if loader is None or not os.path.exists(loader):
        pytest.skip("no ELF interpreter to run the program under")
    env = clean_env(FAKE_CUDART_PATH=FAKE_CUDART, PYTORCH_CUDA_ALLOC_CONF="tidepool.log:off")
    result = subprocess.run(
        [loader, "--inhibit-cache", "--preload", PRELOAD, sys.executable, "-c",
         PRELUDE + CALLS + "print(json.dumps(out))\n"],
        env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["malloc_rc"] == 0 and out["fake_frees"] == 1
    assert "after tidepool was set up" not in result.stderr
