"""What the LD_PRELOAD shim's tests against the stand-in libcudart share (test_preload.py,
test_preload_default_streams.py): the programs' preludes, which bind the process's CUDA
functions (the shim's) and the fake's counters, and the runner."""

from __future__ import annotations

import os

import pytest

PRELOAD = os.environ.get("TIDEPOOL_PRELOAD_LIBRARY", "")
FAKE_CUDART = os.environ.get("TIDEPOOL_TEST_FAKE_CUDART", "")
HOST_STREAMS = os.environ.get("TIDEPOOL_TEST_HOST_STREAMS", "")

needs_preload = pytest.mark.skipif(
    not os.path.isfile(PRELOAD),
    reason="TIDEPOOL_PRELOAD_LIBRARY not built (a build without CUDA)")


# The checks below run in a fresh interpreter with the shim preloaded and the fake
# libcudart as "CUDA"; each prints one JSON line. PRELUDE binds the process's
# cudaMalloc/cudaFree and cudaMallocAsync/cudaFreeAsync (the shim's) and the fake's
# counters. The fake is found through TIDEPOOL_CUDART unless a test loads it into the
# global scope itself (FAKE_GLOBAL=1), as a program linked against its runtime has it.
PRELUDE = """
import ctypes, json, os
c_void_p, byref = ctypes.c_void_p, ctypes.byref
fake_path = os.environ["FAKE_CUDART_PATH"]
fake = ctypes.CDLL(fake_path, mode=ctypes.RTLD_GLOBAL if os.environ.get("FAKE_GLOBAL") else 0)
process = ctypes.CDLL(None)
process.cudaMalloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
process.cudaFree.argtypes = [ctypes.c_void_p]
process.cudaMallocAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
process.cudaFreeAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
process.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
fake.cudaMallocAsync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
fake.cudaMallocAsync_ptsz.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
counter = lambda name: ctypes.c_int.in_dll(fake, name).value
def bind_ptsz():   # the process's _ptsz functions, looked up once the shim has set up
    process.cudaMallocAsync_ptsz.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    process.cudaFreeAsync_ptsz.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
out = {}
"""


def run_with_fake(run_python, code, *, global_scope=False, timeout=120, **variables):
    import json
    env = {"FAKE_CUDART_PATH": FAKE_CUDART, **variables}
    if global_scope:
        env["FAKE_GLOBAL"] = "1"
    else:
        env["TIDEPOOL_CUDART"] = FAKE_CUDART
    result = run_python(PRELUDE + code + "\nprint(json.dumps(out))\n", preload=PRELOAD,
                        timeout=timeout, **env)
    return json.loads(result.stdout.strip().splitlines()[-1]), result.stderr


needs_fake = pytest.mark.skipif(not os.path.isfile(FAKE_CUDART), reason="fake libcudart not built")


# Note [destroyed streams] in preload/tidepool_preload.cpp. The fake's cudaStreamCreate hands
# out one fixed handle (0x5200), which the host backend does not know, unless a test loads
# the host-streams helper: then each handle is a host-backend stream tidepool can wait for.
# fake_cudart_destroy_saw_tidepool_stream: whether tidepool's snapshot still named the
# stream when the real cudaStreamDestroy ran.
DESTROY_PRELUDE = """
r = c_void_p()
process.cudaMalloc(byref(r), 4 << 20)   # tidepool is set up, the NULL stream's pool is large
import tidepool
names = lambda stream: any(seg["stream"] == hex(stream.value)
                           for seg in tidepool.snapshot(0)["segments"])
"""



# Note [streams tidepool is given] in preload/tidepool_preload.cpp. With the host-streams
# helper, the fake's streams are host-backend streams of the current device, events work
# across devices, and host_streams_hold keeps a stream's work back until host_streams_open:
# a block freed on a held stream must stay out of reach until the stream passes the free.
STREAMS_PRELUDE = DESTROY_PRELUDE + """
helper = ctypes.CDLL(os.environ["HOST_STREAMS"], mode=ctypes.RTLD_GLOBAL)
helper.host_streams_hold.argtypes = [ctypes.c_void_p, ctypes.c_int]
def on_device(device):
    os.environ["FAKE_CUDART_DEVICE"] = str(device)
def create_stream():
    s = c_void_p()
    fake.cudaStreamCreate(byref(s))
    return s
def settle(device):   # the gate opened, every stream of the device done
    helper.host_streams_open()
    helper.host_streams_synchronize_device(device)
LARGE = 4 << 20   # the large pools: no thread cache
"""

needs_host_streams = pytest.mark.skipif(not os.path.isfile(HOST_STREAMS),
                                        reason="host-streams helper not built")
