"""libtidepool.so must not bring a second malloc into the process.

Debian's libmimalloc.so.2 overrides malloc/free/new/delete; while libtidepool linked it,
loading libtidepool RTLD_GLOBAL after torch, or RTLD_LOCAL before it, crashed when
triton's extension loaded (memory from one allocator freed by the other). libtidepool
now dlopen()s mimalloc RTLD_LOCAL for its pinned host arena only (Note [mimalloc is
loaded RTLD_LOCAL] in tiering/host_arena.cpp). These tests run exactly those two orders
(and the other two) in fresh interpreters.
"""

from __future__ import annotations

import os

import pytest

_SCRIPT = """
import ctypes, os
path = os.environ["TIDEPOOL_LIBRARY"]
mode = ctypes.RTLD_{mode}

def load_tidepool():
    ctypes.CDLL(path, mode=mode)
    with open("/proc/self/maps") as maps:
        assert "libmimalloc" not in maps.read(), "loading libtidepool.so mapped libmimalloc"
    # What the host arena does on its first pinned slab.
    ctypes.CDLL("libmimalloc.so.2", mode=ctypes.RTLD_LOCAL)

if "{order}" == "before":
    load_tidepool()
import torch
if "{order}" == "after":
    load_tidepool()
import triton
x = torch.randn(256, 256)
assert torch.isfinite(x @ x).all()
print("loaded", "{mode}", "{order}")
"""


@pytest.mark.parametrize("mode,order", [("GLOBAL", "after"), ("LOCAL", "before"),
                                        ("GLOBAL", "before"), ("LOCAL", "after")])
def test_libtidepool_loads_in_any_order_with_torch_and_triton(run_python, mode, order):
    pytest.importorskip("triton")
    result = run_python(_SCRIPT.format(mode=mode, order=order), hook_first=False,
                        TIDEPOOL_LIBRARY=os.environ["TIDEPOOL_LIBRARY"])
    assert f"loaded {mode} {order}" in result.stdout
