"""A program that used PyTorch's memory history in global mode ends cleanly (Note [the
installed allocator is never destroyed] in optimizers/install/torch_cuda_allocator.cpp).
On the H200 (2026-12-04) the memory_history check passed and then died at exit with
"double free or corruption": the stacks the history keeps are PyTorch's
CapturedTracebacks, whose destructor hands their Python frames to a free list in
libtorch_python, and the allocator holding them was destroyed by libtorch_cuda's static
destructors, after that list's. Here a fresh interpreter installs libtidepool_torch_cuda
over the host backend, records history with PyTorch's own Python stack recorder
(torch_history.cpp: _record_memory_history itself initialises CUDA), allocates and frees
from nested Python frames, turns the history off and on (its stacks go to the free list,
which so holds memory), records more, keeps some blocks live, and exits."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest


def _helper() -> str:
    """libtidepool_test_torch_history.so: ctest names it; a build's tests/python
    directory holds it next to the host-streams library otherwise."""
    named = os.environ.get("TIDEPOOL_TEST_TORCH_HISTORY")
    if named:
        return named
    streams = os.environ.get("TIDEPOOL_TEST_HOST_STREAMS", "")
    guess = os.path.join(os.path.dirname(streams), "libtidepool_test_torch_history.so")
    return guess if streams and os.path.exists(guess) else ""


HELPER = _helper()
TORCH_CUDA = os.environ.get("TIDEPOOL_TORCH_CUDA_LIBRARY", "")

SCRIPT = textwrap.dedent("""
    import ctypes, sys
    import torch
    library, torch_cuda, helper = sys.argv[1:4]
    lib = ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
    lib.tidepool_last_error.restype = ctypes.c_char_p
    assert lib.tidepool_set_backend(b"host") == 0, lib.tidepool_last_error()
    shim = ctypes.CDLL(torch_cuda, mode=ctypes.RTLD_GLOBAL)
    assert shim.tidepool_torch_install_cuda_allocator() == 0, lib.tidepool_last_error()
    h = ctypes.CDLL(helper)
    h.tidepool_test_alloc.restype = ctypes.c_void_p
    h.tidepool_test_alloc.argtypes = [ctypes.c_size_t]
    h.tidepool_test_free.argtypes = [ctypes.c_void_p]

    def churn(count, keep):  # allocations, all but `keep` freed, each with its stack
        blocks = [h.tidepool_test_alloc(4096 * (i + 1)) for i in range(count)]
        for b in blocks[keep:]:
            h.tidepool_test_free(b)
        return blocks[:keep]

    def nested(depth, count, keep):  # deeper Python stacks, more frames per stack
        return nested(depth - 1, count, keep) if depth else churn(count, keep)

    h.tidepool_test_record_history(1)
    live = nested(20, 50, 5)
    h.tidepool_test_record_history(0)  # dropped: their frames go to PyTorch's free list
    h.tidepool_test_record_history(1)
    live += nested(30, 400, 20)
    print("RECORDED", len(live), flush=True)
    """)


@pytest.mark.skipif(not (HELPER and TORCH_CUDA),
                    reason="needs libtidepool_torch_cuda and libtidepool_test_torch_history")
def test_a_program_that_recorded_the_memory_history_exits_cleanly():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, os.environ["TIDEPOOL_LIBRARY"], TORCH_CUDA, HELPER],
        capture_output=True, text=True, timeout=120,
        env={k: v for k, v in os.environ.items()
             if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "TIDEPOOL_ALLOC_CONF",
                          "LD_PRELOAD")})
    assert result.stdout.strip() == "RECORDED 25", result.stderr
    assert result.returncode == 0, (f"exit status {result.returncode} after the program ended:\n"
                                    f"{result.stderr[-2000:]}")
