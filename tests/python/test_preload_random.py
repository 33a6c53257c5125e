"""The LD_PRELOAD shim through random sequences of CUDA calls, against the stand-in
libcudart (fake_cudart.c) on the host backend: cudaMalloc, cudaMallocAsync and their
frees on the NULL stream, interleaved with frees tidepool must refuse (a block freed
again, a pointer inside a live block) and frees of memory the runtime gave out itself,
which the shim must forward. A model of the live blocks checks every answer:
  - every allocation succeeds, and the bytes written into a block are there at its free;
  - a refused free answers cudaErrorInvalidValue, which cudaGetLastError then reports
    once, reaches no runtime free and changes nothing;
  - each foreign free reaches the runtime's cudaFree or cudaFreeAsync exactly once, and
    no free of tidepool's memory ever does;
  - tidepool's live allocations are the model's after every call.
TIDEPOOL_TEST_SEED draws other sequences; TIDEPOOL_TEST_SCALE makes them longer."""

from __future__ import annotations

import pytest

from preload_fake import needs_fake, needs_preload, run_with_fake
from random_sequences import scaled, seeds

pytestmark = [needs_preload, needs_fake]

RANDOM_CALLS = """
import random
# The shim's first cudaMalloc sets tidepool up (on the host backend) before Python loads
# libtidepool: loaded first, its libcudart would become the forwarding target.
first = c_void_p()
assert process.cudaMalloc(byref(first), 1 << 20) == 0 and process.cudaFree(first) == 0
import tidepool
rng = random.Random(SEED)
live = {}      # tidepool's blocks: address -> (size, byte written)
freed = []     # addresses freed, for frees again
foreign = []   # the runtime's own blocks
live_count = lambda: tidepool.stats(0)["allocation.all.current"]
runtime_frees = lambda: counter("fake_cudart_free_calls") + counter("fake_cudart_free_async_calls")
fake.cudaMalloc.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
problems = []
done = {}      # kind -> calls made
expected_runtime_frees = runtime_frees()
for op in range(OPERATIONS):
    kind = rng.choices(["malloc", "free", "free again", "free inside", "foreign"],
                       weights=[40, 35, 8, 7, 10])[0]
    use_async = rng.random() < 0.5
    if kind == "malloc" or (kind in ("free", "free inside") and not live):
        p = c_void_p()
        size = rng.choice([rng.randint(1, 4096), rng.randint(4097, 3 << 20)])
        rc = process.cudaMallocAsync(byref(p), size, None) if use_async else \\
            process.cudaMalloc(byref(p), size)
        if rc != 0 or not p.value or p.value in live:
            problems.append((op, "malloc", rc, p.value))
            break
        value = rng.randint(1, 255)
        ctypes.memset(p.value, value, size)
        live[p.value] = (size, value)
    elif kind == "free":
        address = rng.choice(list(live))
        size, value = live.pop(address)
        for at in {0, size // 2, size - 1}:
            if ctypes.string_at(address + at, 1)[0] != value:
                problems.append((op, "bytes changed", hex(address), at))
        rc = process.cudaFreeAsync(c_void_p(address), None) if use_async else \\
            process.cudaFree(c_void_p(address))
        if rc != 0:
            problems.append((op, "free", rc))
        freed.append(address)
    elif kind in ("free again", "free inside"):
        if kind == "free again":
            stale = [a for a in freed if a not in live]
            if not stale:
                continue
            address = rng.choice(stale)
        else:
            base = rng.choice([a for a, (size, _) in live.items() if size > 1] or [None])
            if base is None:
                continue
            address = base + rng.randint(1, live[base][0] - 1)
        rc = process.cudaFreeAsync(c_void_p(address), None) if use_async else \\
            process.cudaFree(c_void_p(address))
        error, after = process.cudaGetLastError(), process.cudaGetLastError()
        if (rc, error, after) != (1, 1, 0):
            problems.append((op, kind, rc, error, after))
    else:
        if foreign and rng.random() < 0.6:
            address = foreign.pop(rng.randrange(len(foreign)))
            rc = process.cudaFreeAsync(c_void_p(address), None) if use_async else \\
                process.cudaFree(c_void_p(address))
            expected_runtime_frees += 1
            if rc != 0:
                problems.append((op, "foreign free", rc))
        else:
            p = c_void_p()
            fake.cudaMalloc(byref(p), rng.randint(1, 8192))
            foreign.append(p.value)
    done[kind] = done.get(kind, 0) + 1
    if runtime_frees() != expected_runtime_frees:
        problems.append((op, kind, "runtime frees", runtime_frees(), expected_runtime_frees))
        expected_runtime_frees = runtime_frees()
    if live_count() != len(live):
        problems.append((op, kind, "live", live_count(), len(live)))
    if len(problems) > 5:
        break
for address in live:
    process.cudaFree(c_void_p(address))
for address in foreign:
    process.cudaFree(c_void_p(address))
out["problems"] = [list(map(str, p)) for p in problems]
out["live_at_end"] = live_count()
out["kinds"] = sorted(done)
"""


@pytest.mark.parametrize("seed", seeds(2))
def test_random_cuda_calls_through_the_shim_match_the_model(run_python, seed):
    code = RANDOM_CALLS.replace("SEED", str(seed)).replace("OPERATIONS", str(scaled(600)))
    out, stderr = run_with_fake(run_python, code, TIDEPOOL_BACKEND="host")
    assert out == {"problems": [], "live_at_end": 0,
                   "kinds": ["foreign", "free", "free again", "free inside", "malloc"]}, stderr
