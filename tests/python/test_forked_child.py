"""A process forked after tidepool allocated (a DataLoader worker under the fork start
method) through the Python package, against the real libtidepool on its host backend
(Note [Forked child] in allocator/fork_guard.h): dropping memory it inherited is silent,
tidepool.stats()/evict() raise RuntimeError naming the cause and the fix, tags work
(tidepool.region, and a CPU optimizer's step under the optimizer step hooks, as in
Hogwild-style training under the fork start method: Note [Tags across fork] in
allocator/tags.cpp), and the parent goes on as before. One fresh interpreter per run."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, os
import torch
import tidepool
from tidepool import _config, _lib, _optim_hooks

_config.apply("backend:tidepool,tidepool.device_backend:host")
hooks = _optim_hooks.register(torch)  # what install() registers where CUDA is
lib = _lib.load()
p = lib.tidepool_malloc(1 << 20, 0, None)
assert p, _lib.last_error()
before = tidepool.stats(0)["allocated_bytes.all.current"]


def attempt(call):
    try:
        call()
        return ["returned", ""]
    except RuntimeError as e:
        return ["RuntimeError", str(e)]


def regions():
    with tidepool.region("activation"):
        with tidepool.region("made_in_the_child"):
            pass


def cpu_steps():
    p = torch.nn.Parameter(torch.ones(8))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9)  # makes state in its first step
    for _ in range(3):
        p.grad = torch.full((8,), 0.5)
        optimizer.step()
    return p.detach().tolist()


read_end, write_end = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read_end)
    child = {}
    lib.tidepool_clear_error()
    lib.tidepool_free(p, 1 << 20, 0, None)
    child["free_error"] = _lib.last_error()
    child["stats"] = attempt(lambda: tidepool.stats(0))
    child["evict"] = attempt(lambda: tidepool.evict("optimizer_state", device=0))
    child["malloc_null"] = not lib.tidepool_malloc(4096, 0, None)
    child["regions"] = attempt(regions)
    try:
        child["cpu_steps"] = cpu_steps()
    except RuntimeError as e:
        child["cpu_steps"] = str(e)
    child["tag_after"] = lib.tidepool_tag_current()
    os.write(write_end, json.dumps(child).encode())
    os._exit(0)
os.close(write_end)
chunks = []
while True:
    chunk = os.read(read_end, 65536)
    if not chunk:
        break
    chunks.append(chunk)
_, status = os.waitpid(pid, 0)
out = {"child": json.loads(b"".join(chunks) or b"null"), "child_status": status}
out["parent_allocated_unchanged"] = tidepool.stats(0)["allocated_bytes.all.current"] == before
out["parent_cpu_steps"] = cpu_steps()
lib.tidepool_free(p, 1 << 20, 0, None)
out["parent_free_error"] = _lib.last_error()
out["parent_allocated_after_free"] = tidepool.stats(0)["allocated_bytes.all.current"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def report():
    from conftest import clean_env

    result = subprocess.run([sys.executable, "-c", SCRIPT], env=clean_env(),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_child_drops_inherited_memory_silently(report):
    assert report["child_status"] == 0
    assert report["child"]["free_error"] == ""


def test_the_child_is_told_why_and_what_to_do_instead(report):
    child = report["child"]
    for call in ("stats", "evict"):
        kind, message = child[call]
        assert kind == "RuntimeError", (call, child[call])
        assert "forked" in message and "spawn" in message, message
    assert child["malloc_null"]


def test_the_parent_is_untouched(report):
    assert report["parent_allocated_unchanged"]
    assert report["parent_free_error"] == ""
    assert report["parent_allocated_after_free"] == 0


def test_the_child_uses_tags_and_steps_a_cpu_optimizer_under_the_hooks(report):
    child = report["child"]
    assert child["regions"] == ["returned", ""]
    assert child["cpu_steps"] == report["parent_cpu_steps"]  # the step ran, as in the parent
    assert child["tag_after"] == 0  # every scope closed: untagged again
