"""tidepool.enable_peer_access() against the real libtidepool on its host backend (which
emulates devices 0..15): the call reaches tidepool_enable_peer_access, accepts the device
forms the other functions accept, and turns tidepool's errors into RuntimeError. (What the
grant does is tested in C++: tests/allocator/test_peer_access.cpp and test_c_api.cpp.)"""

from __future__ import annotations

import json

SCRIPT = """
import json
import torch
import tidepool
from tidepool import _config, _lib

_config.apply("backend:tidepool,tidepool.device_backend:host")
lib = _lib.load()
out = {"in_all": "enable_peer_access" in tidepool.__all__}
out["ints"] = tidepool.enable_peer_access(0, 1)
out["forms"] = tidepool.enable_peer_access("cuda:2", torch.device("cuda", 3))
out["again"] = tidepool.enable_peer_access(0, 1)
errors = {}
for name, args in {"self": (1, 1), "no_peer": (0, 99), "no_device": (-1, 0)}.items():
    try:
        tidepool.enable_peer_access(*args)
    except RuntimeError as e:
        errors[name] = str(e)
out["errors"] = errors
try:
    tidepool.enable_peer_access("cpu", 1)
except ValueError as e:
    out["cpu"] = str(e)
# A device granted before its first allocation still allocates.
p = lib.tidepool_malloc(1 << 20, 2, None)
out["allocates"] = bool(p)
lib.tidepool_free(p, 1 << 20, 2, None)
print(json.dumps(out))
"""


def test_enable_peer_access_reaches_tidepool_and_raises_its_errors(run_python):
    report = json.loads(run_python(SCRIPT, hook_first=False).stdout.strip().splitlines()[-1])
    assert report["in_all"]
    assert report["ints"] is None and report["forms"] is None and report["again"] is None
    assert report["allocates"]
    errors = report["errors"]
    assert "enable_peer_access(1, 1) failed" in errors["self"]
    assert "cannot be its own peer" in errors["self"]
    assert "peer device 99 does not exist" in errors["no_peer"]
    assert "device -1 does not exist" in errors["no_device"]
    assert "not a CUDA device" in report["cpu"]
