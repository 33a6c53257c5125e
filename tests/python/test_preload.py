"""libtidepool_preload.so at process start-up (LD_PRELOAD): it claims the same keys with
the same parser before the program runs, stops on a bad key, and leaves programs alone
otherwise. Routing, forwarding and error codes are checked against a stand-in libcudart
(fake_cudart.c); routing on a real GPU: scripts/gpu_e2e_llama.py."""

from __future__ import annotations

import json
import os

import pytest

from preload_fake import (DESTROY_PRELUDE, FAKE_CUDART, HOST_STREAMS, PRELOAD, PRELUDE,
                          STREAMS_PRELUDE, needs_fake, needs_host_streams, needs_preload,
                          run_with_fake)

pytestmark = needs_preload

SHOW_ENV = """
import os, sys
import tidepool
print(repr(os.environ.get("PYTORCH_CUDA_ALLOC_CONF")), any(
    type(f).__name__ == "_TorchImportFinder" for f in sys.meta_path))
print(tidepool.status())
"""


def test_keys_are_claimed_before_the_program_starts(run_python):
    result = run_python(SHOW_ENV, preload=PRELOAD,
                        PYTORCH_CUDA_ALLOC_CONF="backend:tidepool,max_split_size_mb:64,"
                                                "tidepool.log:info")
    # Rewritten before Python started; the Python hook stands aside (no import finder):
    # PyTorch keeps its allocator, whose cudaMalloc calls the shim serves.
    lines = result.stdout.strip().splitlines()
    assert lines[0].split() == ["'max_split_size_mb:64'", "False"]
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


@pytest.mark.parametrize("backend", ["cudaMallocAsync", "native"])
def test_another_pytorch_backend_next_to_tidepool_keys_is_fine_under_the_shim(run_python, backend):
    # PyTorch's allocator, whichever it is, calls what the shim serves (Note [one backend]
    # in allocator/config.cpp); without the shim the same variables are a conflict.
    result = run_python(SHOW_ENV, preload=PRELOAD,
                        PYTORCH_CUDA_ALLOC_CONF=f"backend:{backend},tidepool.log:info")
    lines = result.stdout.strip().splitlines()
    assert lines[0].split() == [f"'backend:{backend}'", "False"]
    assert lines[1] == "active: through the LD_PRELOAD shim (libtidepool_preload.so)"
    assert result.stderr.startswith('tidepool preload: active: {"enabled":true,"mode":"global",')


def test_expandable_segments_under_the_shim_stop_the_program(run_python):
    # Note [expandable segments] in allocator/config.cpp: PyTorch maps them with
    # cuMemCreate, which the shim does not see; tidepool would serve nothing, silently.
    # (The key in the variable PyTorch reads: Note [the variable PyTorch reads].)
    result = run_python("print('should not run')", check=False, preload=PRELOAD,
                        PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True",
                        PYTORCH_ALLOC_CONF="tidepool.log:info")
    assert result.returncode == 2
    assert result.stdout == ""
    assert ("conflicts with 'expandable_segments:True' in PYTORCH_CUDA_ALLOC_CONF: PyTorch then "
            "maps its memory with the driver's cuMemCreate") in result.stderr


CHILD_MAPS = """
import subprocess, sys
child = subprocess.run([sys.executable, "-c", "import os; "
    "maps = open('/proc/self/maps').read(); "
    "print('libtidepool.so' in maps, 'libtidepool_preload' in maps, "
    "os.environ.get('TIDEPOOL_ALLOC_CONF'))"], capture_output=True, text=True)
print(child.stdout.strip())
print("CHILD STDERR", repr(child.stderr))
"""


def test_a_child_that_never_allocates_loads_nothing(run_python):
    # Review finding: every child that inherits LD_PRELOAD (a shell, the compilers a
    # torch.compile run starts) set the shim up before main, loading libcudart and
    # libtidepool and, under tidepool.log:info, saying so, because the inherited
    # TIDEPOOL_ALLOC_CONF named tidepool. Only PyTorch's variables need claiming before main.
    result = run_python(CHILD_MAPS, preload=PRELOAD,
                        PYTORCH_CUDA_ALLOC_CONF="backend:tidepool,tidepool.log:info")
    lines = result.stdout.strip().splitlines()
    assert lines[0].split() == ["False", "True", "backend:tidepool,tidepool.log:info"]
    assert lines[1] == "CHILD STDERR ''"
    assert result.stderr.count("tidepool preload: active:") == 1  # the parent's


CHILD_ALLOCATES = """
import subprocess, sys
code = PRELUDE + (
    "r = c_void_p()\\n"
    "out['malloc'] = process.cudaMalloc(byref(r), 1 << 20)\\n"
    "import tidepool\\n"
    "out['budget'] = tidepool.config()['state_budget']\\n"
    "out['served'] = tidepool.snapshot(0)['segments'] != []\\n"
    "print(json.dumps(out))\\n")
child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
print(child.stdout.strip().splitlines()[-1] if child.stdout.strip() else child.stderr)
"""


@needs_fake
def test_a_child_that_allocates_applies_the_inherited_configuration(run_python):
    # The other half: set up at its first cudaMalloc, the child serves it with the parent's
    # keys (here its state budget).
    code = "PRELUDE = " + repr(PRELUDE) + "\n" + CHILD_ALLOCATES
    result = run_python(code, preload=PRELOAD, FAKE_CUDART_PATH=FAKE_CUDART,
                        TIDEPOOL_CUDART=FAKE_CUDART,
                        PYTORCH_CUDA_ALLOC_CONF="tidepool.state_budget:3GiB,tidepool.log:off")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"malloc": 0, "budget": {"kind": "bytes", "bytes": 3 << 30}, "served": True}


@needs_fake
def test_keys_set_at_run_time_are_claimed_by_the_shim_before_pytorch_reads_them(run_python):
    # Review finding: with nothing named at start-up the shim waits for the first
    # cudaMalloc, and tidepool.install() took that for "the shim serves tidepool": the keys
    # set since stayed in the variable, where PyTorch rejects them. They are claimed, and
    # the shim set up with them, at `import torch` now (Note [named after start-up] in
    # _autoload.py), before PyTorch reads them; install() then finds it done.
    result = run_python("""
        import os, json, ctypes
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = (
            "backend:tidepool,tidepool.log:off,max_split_size_mb:64")
        import torch, tidepool
        state = ctypes.CDLL(None).tidepool_preload_state
        before = state()
        print(json.dumps([before, tidepool.install(), state(),
                          os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), tidepool.config()["log"]]))
    """, preload=PRELOAD, FAKE_CUDART_PATH=FAKE_CUDART, TIDEPOOL_CUDART=FAKE_CUDART)
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [
        1, "active: through the LD_PRELOAD shim (libtidepool_preload.so)", 1,
        "max_split_size_mb:64", "off"]


INSTALL_UNDER_A_WAITING_SHIM = """
import os, json, ctypes
import torch, tidepool
state = ctypes.CDLL(None).tidepool_preload_state
out = {"before": state()}
for conf in CONFS:
    try:
        out[conf] = tidepool.install(conf)
    except tidepool.ConfigError as e:
        out[conf] = "ConfigError: " + str(e)
out.update(after=state(), inherited=os.environ.get("TIDEPOOL_ALLOC_CONF"),
           budget=tidepool.config()["state_budget"])
print(json.dumps(out))
"""
ACTIVE = "active: through the LD_PRELOAD shim (libtidepool_preload.so)"


@needs_fake
def test_install_with_keys_sets_a_waiting_shim_up_with_them(run_python):
    # Review finding: with nothing named at start-up, tidepool.install(conf) compared conf
    # with a configuration the shim had not claimed yet, and refused every conf.
    confs = ["tidepool.log:off,tidepool.state_budget:3GiB", "tidepool.log:off"]
    result = run_python(f"CONFS = {confs!r}\n" + INSTALL_UNDER_A_WAITING_SHIM, preload=PRELOAD,
                        FAKE_CUDART_PATH=FAKE_CUDART, TIDEPOOL_CUDART=FAKE_CUDART)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["before"] == -1 and out["after"] == 1
    assert out[confs[0]] == ACTIVE
    assert out[confs[1]].startswith("ConfigError: tidepool.install(): the LD_PRELOAD shim "
                                    "serves tidepool with the configuration it claimed")
    assert out["inherited"] == confs[0]  # what child processes apply
    assert out["budget"] == {"kind": "bytes", "bytes": 3 << 30}


@needs_fake
def test_install_under_a_waiting_shim_keeps_to_the_inherited_configuration(run_python):
    confs = ["tidepool.log:off,tidepool.state_budget:3GiB",
             "tidepool.log:off,tidepool.state_budget:1GiB"]
    result = run_python(f"CONFS = {confs!r}\n" + INSTALL_UNDER_A_WAITING_SHIM, preload=PRELOAD,
                        FAKE_CUDART_PATH=FAKE_CUDART, TIDEPOOL_CUDART=FAKE_CUDART,
                        TIDEPOOL_ALLOC_CONF=confs[1])
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out[confs[0]].startswith("ConfigError: tidepool.install(): the LD_PRELOAD shim "
                                    "serves tidepool with the configuration the environment")
    assert out[confs[1]] == ACTIVE
    assert out["before"] == -1 and out["after"] == 1
    assert out["inherited"] == confs[1]
    assert out["budget"] == {"kind": "bytes", "bytes": 1 << 30}


RUN_TIME_KEYS = """
import os, json, ctypes
os.environ["PYTORCH_CUDA_ALLOC_CONF"] = CONF
try:
    import torch  # claims them (Note [named after start-up] in _autoload.py)
    import tidepool
    out = tidepool.install()
except Exception as e:  # tidepool.ConfigError, at `import torch`
    out = type(e).__name__ + ": " + str(e)
print(json.dumps([out, ctypes.CDLL(None).tidepool_preload_state()]))
"""


@needs_fake
@pytest.mark.parametrize("conf,expected", [
    # The shim's rules, not the hook's: an error the shim would end the process with is a
    # ConfigError, and what the shim accepts is accepted.
    ("backend:tidepool,expandable_segments:True",
     "ConfigError: PYTORCH_CUDA_ALLOC_CONF: tidepool conflicts with "
     "'expandable_segments:True': PyTorch then maps its memory with the driver's cuMemCreate"),
    ("tidepool.log:off,backend:cudaMallocAsync", ACTIVE),
], ids=["refused-by-the-shim", "accepted-by-the-shim"])
def test_keys_set_at_run_time_are_checked_by_the_shims_rules(run_python, conf, expected):
    result = run_python(f"CONF = {conf!r}\n" + RUN_TIME_KEYS, preload=PRELOAD,
                        FAKE_CUDART_PATH=FAKE_CUDART, TIDEPOOL_CUDART=FAKE_CUDART)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out[0].startswith(expected), out
    assert out[1] == (1 if out[0] == ACTIVE else -1)


@needs_fake
def test_an_inherited_configuration_the_waiting_shim_would_refuse_is_a_config_error(run_python):
    # Review finding: with only TIDEPOOL_ALLOC_CONF set the shim waits for the first
    # cudaMalloc, and a key it refuses then ended the process (status 2) there; the hook
    # now checks it by the shim's rules, and `import torch` raises it, as the hook's own.
    result = run_python("""
        import json, ctypes
        try:
            import torch
            out = "imported"
        except Exception as e:
            out = type(e).__name__ + ": " + str(e)
        import tidepool
        print(json.dumps([out, ctypes.CDLL(None).tidepool_preload_state(), tidepool.status()]))
    """, preload=PRELOAD, FAKE_CUDART_PATH=FAKE_CUDART, TIDEPOOL_CUDART=FAKE_CUDART,
                        TIDEPOOL_ALLOC_CONF="tidepool.log:loud")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out[0].startswith("ConfigError: TIDEPOOL_ALLOC_CONF: tidepool.log: 'loud'"), out
    assert out[1] == -1  # not set up: nothing ended the process
    assert out[2].startswith("failed: TIDEPOOL_ALLOC_CONF: tidepool.log")


@needs_fake
def test_install_with_keys_the_shim_refuses_leaves_the_inherited_variable_unset(run_python):
    result = run_python("""
        import os, json
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        import torch, tidepool
        try:
            out = tidepool.install("tidepool.log:off")
        except tidepool.ConfigError as e:
            out = "ConfigError: " + str(e)
        print(json.dumps([out, os.environ.get("TIDEPOOL_ALLOC_CONF")]))
    """, preload=PRELOAD, FAKE_CUDART_PATH=FAKE_CUDART, TIDEPOOL_CUDART=FAKE_CUDART)
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "conflicts with 'expandable_segments:True'" in out[0]
    assert out[1] is None  # children would otherwise apply what was refused


def test_without_tidepool_keys_the_environment_is_untouched(run_python):
    result = run_python(SHOW_ENV, preload=PRELOAD, PYTORCH_CUDA_ALLOC_CONF="max_split_size_mb:64")
    assert result.stdout.strip().splitlines()[0].split() == ["'max_split_size_mb:64'", "False"]
    assert result.stderr == ""


def test_pool_mode_is_explained(run_python):
    result = run_python(SHOW_ENV, preload=PRELOAD, PYTORCH_ALLOC_CONF="tidepool.mode:pool")
    assert "tidepool.mode:pool needs the Python package" in result.stderr



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




@needs_fake
@pytest.mark.parametrize("variables", [
    {"PYTORCH_CUDA_ALLOC_CONF": "tidepool.device_backend:host"},
    {"TIDEPOOL_BACKEND": "host"},
], ids=["key", "environment"])
def test_the_host_backend_serves_no_cuda_malloc_where_the_runtime_sees_a_device(
        run_python, variables):
    """Note [device memory only] in preload/libraries.cpp: tidepool's host backend hands out
    host memory, which a kernel cannot use (review finding: returned with cudaSuccess).
    With a device in sight the shim is off and says why; the runtime gets the calls."""
    out, stderr = run_with_fake(run_python, """
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 1 << 20)
out["cuda_mallocs"] = counter("fake_cudart_malloc_calls")
out["free_rc"] = process.cudaFree(p)
out["cuda_frees"] = counter("fake_cudart_free_calls")
out["last_error"] = process.cudaGetLastError()
""", FAKE_CUDART_DEVICE_COUNT="1", **variables)
    assert out == {"malloc_rc": 0, "cuda_mallocs": 1, "free_rc": 0, "cuda_frees": 1,
                   "last_error": 0}
    assert stderr.count("tidepool preload:") == 1
    assert ("host backend (tidepool.device_backend:host or TIDEPOOL_BACKEND=host) cannot serve "
            "cudaMalloc") in stderr


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
out["malloc_async_rc"] = process.cudaMallocAsync(byref(p), 4096, None)
out["cuda_malloc_asyncs"] = counter("fake_cudart_malloc_async_calls")
out["free_async_rc"] = process.cudaFreeAsync(p, None)
out["cuda_free_asyncs"] = counter("fake_cudart_free_async_calls")
s = c_void_p()
fake.cudaStreamCreate(byref(s))
out["stream_destroy_rc"] = process.cudaStreamDestroy(s)
out["cuda_stream_destroys"] = counter("fake_cudart_stream_destroy_calls")
bind_ptsz()
out["malloc_async_ptsz_rc"] = process.cudaMallocAsync_ptsz(byref(p), 4096, None)
out["free_async_ptsz_rc"] = process.cudaFreeAsync_ptsz(p, None)
out["cuda_ptsz_calls"] = [counter("fake_cudart_malloc_async_ptsz_calls"),
                          counter("fake_cudart_free_async_ptsz_calls")]
"""

FORWARDED_ALL = {"malloc_rc": 0, "malloc_rc_2": 0, "cuda_mallocs": 2, "free_rc": 0,
                 "cuda_frees": 1, "synchronizes": 0, "malloc_async_rc": 0,
                 "cuda_malloc_asyncs": 1, "free_async_rc": 0, "cuda_free_asyncs": 1,
                 "stream_destroy_rc": 0, "cuda_stream_destroys": 1,
                 "malloc_async_ptsz_rc": 0, "free_async_ptsz_rc": 0, "cuda_ptsz_calls": [1, 1]}


@needs_fake
@pytest.mark.parametrize("global_scope", [False, True], ids=["found-by-search", "program's-own"])
def test_another_cuda_major_is_forwarded_untouched(run_python, global_scope):
    # A CUDA 12 program that inherited LD_PRELOAD: tidepool (built for another major) stays
    # out of it, every call reaches the program's runtime, and the shim says so once.
    out, stderr = run_with_fake(run_python, FORWARD_ALL, global_scope=global_scope,
                                FAKE_CUDART_VERSION="12080", TIDEPOOL_BACKEND="host")
    assert out == FORWARDED_ALL
    assert stderr.count("tidepool preload:") == 1
    assert "is version 12.8, but tidepool was built for CUDA" in stderr
    assert ("tidepool is off: every cudaMalloc/cudaFree, cudaMallocAsync/cudaFreeAsync (and "
            "their _ptsz forms), cudaStreamDestroy, cudaIpcGetMemHandle, cudaDeviceReset, the "
            "other allocations (cudaMallocPitch, ...), the memory-pool calls and "
            "cudaDeviceEnablePeerAccess the shim watches, and cudaMemGetInfo goes to that runtime "
            "unchanged") in stderr


@needs_fake
def test_another_cuda_major_is_quiet_under_log_off(run_python):
    out, stderr = run_with_fake(run_python, FORWARD_ALL, FAKE_CUDART_VERSION="12080",
                                PYTORCH_CUDA_ALLOC_CONF="tidepool.log:off")
    assert out == FORWARDED_ALL
    assert stderr == ""


@needs_fake
def test_a_shim_that_turned_itself_off_leaves_the_keys_to_the_python_hook(run_python):
    # Review finding: the hook stood aside whenever the shim was mapped, also when the shim
    # was off (here: a runtime of another major) and had claimed nothing, so the tidepool
    # keys reached PyTorch, which rejects them, and status() said tidepool was active.
    result = run_python(SHOW_ENV, preload=PRELOAD, FAKE_CUDART_PATH=FAKE_CUDART,
                        TIDEPOOL_CUDART=FAKE_CUDART, FAKE_CUDART_VERSION="12080",
                        PYTORCH_CUDA_ALLOC_CONF="backend:tidepool,max_split_size_mb:64,"
                                                "tidepool.state_budget:2GiB")
    lines = result.stdout.strip().splitlines()
    assert lines[0].split() == ["'max_split_size_mb:64'", "True"]  # claimed; hook waits
    assert "LD_PRELOAD" not in lines[1]
    assert "is version 12.8, but tidepool was built for CUDA" in result.stderr


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
# Sizes above tidepool's limit (2^50), a negative one cast among them: the runtime's
# answer for a request it cannot satisfy (Note [sizes beyond any device]).
p = c_void_p(1)
out["beyond_limit_rc"] = process.cudaMalloc(byref(p), (1 << 50) + 1)
out["beyond_limit_ptr"] = p.value
out["negative_rc"] = process.cudaMalloc(byref(p), (1 << 64) - 1)
out["beyond_limit_async_rc"] = process.cudaMallocAsync(byref(p), 1 << 62, None)
# A pointer tidepool no longer owns (freed behind the shim's back): an invalid free.
out["malloc_rc"] = process.cudaMalloc(byref(p), 4096)
# The copy the shim loaded (only now: loaded first, its libcudart would be "CUDA").
tp = ctypes.CDLL(os.environ["TIDEPOOL_LIBRARY"])
tp.tidepool_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
tp.tidepool_free(p, 4096, 0, None)
out["stale_free_rc"] = process.cudaFree(p)
# A device tidepool cannot serve (beyond its kMaxDevices): the runtime's answer, here the
# fake's memory (test_preload_watched_calls.py).
os.environ["FAKE_CUDART_DEVICE"] = "4096"
out["bad_device_rc"] = process.cudaMalloc(byref(p), 4096)
""", TIDEPOOL_BACKEND="host")
    assert out == {"too_big_rc": 2, "too_big_ptr": None,  # cudaErrorMemoryAllocation
                   "beyond_limit_rc": 2, "beyond_limit_ptr": None, "negative_rc": 2,
                   "beyond_limit_async_rc": 2,
                   "malloc_rc": 0, "stale_free_rc": 1,  # cudaErrorInvalidValue
                   "bad_device_rc": 0}
    assert "tidepool preload: cudaMalloc: tidepool: out of memory" in stderr
    assert (f"tidepool preload: cudaMalloc: {(1 << 50) + 1} bytes is more than any device holds "
            "(tidepool's limit is 2^50 bytes)") in stderr
    assert f"tidepool preload: cudaMallocAsync: {1 << 62} bytes is more than any device" in stderr
    assert "device 4096" not in stderr  # the runtime's to answer, not a bad request


@needs_fake
def test_a_free_of_memory_tidepool_holds_never_reaches_the_runtime(run_python):
    # Note [frees of memory tidepool holds]: a double free, or an address inside a block,
    # is not the shim's to serve, but the runtime must not see it either (the fake would
    # free() host-backend memory; CUDA could free tidepool's segment under it). The
    # runtime's answer for a pointer it does not hold, and nothing changes.
    out, _ = run_with_fake(run_python, """
import tidepool
allocated = lambda: tidepool.stats(0)["allocated_bytes.all.current"]
p, q = c_void_p(), c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 4 << 20)
out["free_rc"] = process.cudaFree(p)
out["double_free_rc"] = process.cudaFree(p)          # cached in tidepool now
out["malloc_async_rc"] = process.cudaMallocAsync(byref(q), 4096, None)
out["inside_rcs"] = [process.cudaFree(c_void_p(q.value + 512)),
                     process.cudaFreeAsync(c_void_p(q.value + 512), None)]
out["last_error"] = [process.cudaGetLastError(), process.cudaGetLastError()]
out["allocated"] = allocated()
out["free_async_rc"] = process.cudaFreeAsync(q, None)
out["double_free_async_rc"] = process.cudaFreeAsync(q, None)
out["allocated_at_end"] = allocated()
out["cuda_frees"] = [counter("fake_cudart_free_calls"), counter("fake_cudart_free_async_calls")]
""", TIDEPOOL_BACKEND="host")
    assert out == {"malloc_rc": 0, "free_rc": 0, "double_free_rc": 1,  # cudaErrorInvalidValue
                   "malloc_async_rc": 0, "inside_rcs": [1, 1], "last_error": [1, 0],
                   "allocated": 4096, "free_async_rc": 0, "double_free_async_rc": 1,
                   "allocated_at_end": 0, "cuda_frees": [0, 0]}


# A stream handle for the stream-ordered calls. tidepool keys its pools by it; the host
# backend knows only its NULL stream and refuses to record an event on another, which
# tidepool does when a stream takes memory another stream freed (Note [Cross-stream reuse]):
# the tests keep the NULL stream's memory and STREAM's in different pools (large, small).
STREAM = 0x5100


@needs_fake
def test_stream_ordered_calls_are_served_on_their_stream(run_python):
    # Note [stream-ordered calls]: tidepool's memory, in its stats, on the stream given.
    out, stderr = run_with_fake(run_python, f"""
import tidepool
allocated = lambda: tidepool.stats(0)["allocated_bytes.all.current"]
S = c_void_p({STREAM})
r = c_void_p()
out["plain_malloc_rc"] = process.cudaMalloc(byref(r), 4 << 20)   # the NULL stream's
p = c_void_p()
out["malloc_rc"] = process.cudaMallocAsync(byref(p), 1 << 20, S)
out["allocated"] = allocated() - (4 << 20)
out["segment_streams"] = sorted(seg["stream"] for seg in tidepool.snapshot(0)["segments"])
out["free_rc"] = process.cudaFreeAsync(p, S)
out["allocated_after_free"] = allocated() - (4 << 20)
q = c_void_p()
process.cudaMallocAsync(byref(q), 1 << 20, S)
out["reused_at_once_on_its_stream"] = q.value == p.value
# Either free takes either malloc's memory (CUDA allows both).
out["cuda_free_of_async_rc"] = process.cudaFree(q)
out["free_async_of_malloc_rc"] = process.cudaFreeAsync(r, None)
out["allocated_at_end"] = allocated()
# Only the cudaFree synchronised; none of the above reached "CUDA".
out["synchronizes"] = counter("fake_cudart_synchronize_calls")
out["cuda_calls"] = [counter("fake_cudart_malloc_async_calls"),
                     counter("fake_cudart_free_async_calls"), counter("fake_cudart_free_calls")]
f = c_void_p()
fake.cudaMallocAsync(byref(f), 64, S)   # memory tidepool never saw
out["foreign_free_rc"] = process.cudaFreeAsync(f, S)
out["cuda_free_asyncs"] = counter("fake_cudart_free_async_calls")
z = c_void_p()
out["zero_rc"] = process.cudaMallocAsync(byref(z), 0, S)   # the runtime's answer
out["cuda_malloc_asyncs"] = counter("fake_cudart_malloc_async_calls")
out["null_out_rc"] = process.cudaMallocAsync(None, 16, S)
""", TIDEPOOL_BACKEND="host")
    assert out == {
        "plain_malloc_rc": 0, "malloc_rc": 0, "allocated": 1 << 20,
        "segment_streams": sorted(["0x0", hex(STREAM)]),
        "free_rc": 0, "allocated_after_free": 0, "reused_at_once_on_its_stream": True,
        "cuda_free_of_async_rc": 0, "free_async_of_malloc_rc": 0, "allocated_at_end": 0,
        "synchronizes": 1, "cuda_calls": [0, 0, 0],
        "foreign_free_rc": 0, "cuda_free_asyncs": 1,
        "zero_rc": 0, "cuda_malloc_asyncs": 2, "null_out_rc": 1,  # cudaErrorInvalidValue
    }
    assert stderr == ""


@needs_fake
def test_cuda_malloc_async_allocates_on_the_streams_device(run_python):
    # The stream's device, not the current one: CUDA allocates from the stream's device's pool.
    out, _ = run_with_fake(run_python, f"""
import tidepool
p = c_void_p()
out["malloc_rc"] = process.cudaMallocAsync(byref(p), 4096, c_void_p({STREAM}))
out["allocated"] = [tidepool.stats(d)["allocated_bytes.all.current"] for d in (0, 1)]
out["free_rc"] = process.cudaFreeAsync(p, c_void_p({STREAM}))
out["allocated_after_free"] = tidepool.stats(1)["allocated_bytes.all.current"]
""", TIDEPOOL_BACKEND="host", FAKE_CUDART_STREAM_DEVICE="1")
    assert out == {"malloc_rc": 0, "allocated": [0, 4096], "free_rc": 0,
                   "allocated_after_free": 0}


@needs_fake
def test_cuda_malloc_async_under_graph_capture_is_the_runtimes(run_python):
    # A capturing stream's allocation belongs to the graph (an allocation node; its
    # cudaFreeAsync a free node): forwarded, as is the free of that pointer.
    out, _ = run_with_fake(run_python, f"""
import tidepool
p = c_void_p()
out["malloc_rc"] = process.cudaMallocAsync(byref(p), 4096, c_void_p({STREAM}))
out["cuda_malloc_asyncs"] = counter("fake_cudart_malloc_async_calls")
out["allocated"] = tidepool.stats(0)["allocated_bytes.all.current"]
out["free_rc"] = process.cudaFreeAsync(p, c_void_p({STREAM}))
out["cuda_free_asyncs"] = counter("fake_cudart_free_async_calls")
""", TIDEPOOL_BACKEND="host", FAKE_CUDART_CAPTURING="1")
    assert out == {"malloc_rc": 0, "cuda_malloc_asyncs": 1, "allocated": 0, "free_rc": 0,
                   "cuda_free_asyncs": 1}


@needs_fake
def test_a_nested_forwarded_call_leaves_the_outer_one_inside(run_python):
    # While the shim forwards a cudaFree, the runtime makes nested calls (the fake does:
    # cudaFree(NULL), then cudaMalloc and cudaMallocAsync). The nested allocations must be
    # forwarded too, not served by tidepool: the end of the nested cudaFree must not clear
    # the outer call's "inside" mark (as it would inside tidepool_malloc on the cuda
    # backend). A broken guard can also re-enter the shim's set-up and wait on itself:
    # the process gets a time limit (it needs about a second; the limit is generous for a
    # loaded machine, and still ends a hang).
    import subprocess
    try:
        out, _ = run_with_fake(run_python, NESTED, timeout=120, TIDEPOOL_BACKEND="host")
    except subprocess.TimeoutExpired:
        out = None  # failed outside the handler: the message alone, not the whole command
    if out is None:
        pytest.fail("the process hung in a nested forwarded call (killed after 20 s): the "
                    "shim's 'inside tidepool' guard no longer covers calls the runtime makes")
    assert out == {"malloc_rc": 0, "foreign_free_rc": 0, "nested_forwarded": 1,
                   "nested_async_forwarded": 1}


NESTED = """
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 4096)    # tidepool is set up
q = c_void_p()
fake.cudaMalloc(byref(q), ctypes.c_size_t(64))
os.environ["FAKE_CUDART_NEST"] = "1"
out["foreign_free_rc"] = process.cudaFree(q)
out["nested_forwarded"] = counter("fake_cudart_nested_forwarded")
out["nested_async_forwarded"] = counter("fake_cudart_nested_async_forwarded")
"""


# Note [destroyed streams] in preload/tidepool_preload.cpp. The fake's cudaStreamCreate hands
# out one fixed handle (0x5200), which the host backend does not know, unless a test loads
# the host-streams helper: then each handle is a host-backend stream tidepool can wait for.
# fake_cudart_destroy_saw_tidepool_stream: whether tidepool's snapshot still named the
# stream when the real cudaStreamDestroy ran. DESTROY_PRELUDE: preload_fake.py.


@needs_fake
@pytest.mark.skipif(not os.path.isfile(HOST_STREAMS), reason="host-streams helper not built")
def test_cuda_stream_destroy_releases_the_stream_in_tidepool_first(run_python):
    out, stderr = run_with_fake(run_python, DESTROY_PRELUDE + f"""
ctypes.CDLL(os.environ["HOST_STREAMS"], mode=ctypes.RTLD_GLOBAL)
s = c_void_p()
fake.cudaStreamCreate(byref(s))
p = c_void_p()
process.cudaMallocAsync(byref(p), 4096, s)
process.cudaFreeAsync(p, s)        # cached for s: s's to reuse at once, in order
out["named_before"] = names(s)
out["destroy_rc"] = process.cudaStreamDestroy(s)
out["cuda_stream_destroys"] = counter("fake_cudart_stream_destroy_calls")
out["named_at_real_destroy"] = counter("fake_cudart_destroy_saw_tidepool_stream")
out["named_after"] = names(s)
# tidepool never touches the dead handle again (the host backend would refuse it).
t = c_void_p()
fake.cudaStreamCreate(byref(t))
q = c_void_p()
out["malloc_on_new_rc"] = process.cudaMallocAsync(byref(q), 4096, t)
out["free_on_new_rc"] = process.cudaFreeAsync(q, t)
out["destroy_new_rc"] = process.cudaStreamDestroy(t)
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS)
    assert out == {"named_before": True, "destroy_rc": 0, "cuda_stream_destroys": 1,
                   "named_at_real_destroy": 0, "named_after": False, "malloc_on_new_rc": 0,
                   "free_on_new_rc": 0, "destroy_new_rc": 0}
    assert stderr == ""


@needs_fake
def test_destroying_a_stream_tidepool_never_saw_does_not_wait_for_it(run_python):
    # The fake's handle is unknown to tidepool's host backend: a synchronize would fail
    # (and on a GPU block, which cudaStreamDestroy does not).
    out, stderr = run_with_fake(run_python, DESTROY_PRELUDE + """
s = c_void_p()
fake.cudaStreamCreate(byref(s))
out["destroy_rc"] = process.cudaStreamDestroy(s)
out["cuda_stream_destroys"] = counter("fake_cudart_stream_destroy_calls")
# The NULL, legacy and per-thread handles: the runtime's answer, no release.
out["special_rcs"] = [process.cudaStreamDestroy(c_void_p(h)) for h in (None, 1, 2)]
out["cuda_stream_destroys_after"] = counter("fake_cudart_stream_destroy_calls")
""", TIDEPOOL_BACKEND="host")
    assert out == {"destroy_rc": 0, "cuda_stream_destroys": 1, "special_rcs": [0, 0, 0],
                   "cuda_stream_destroys_after": 4}
    assert stderr == ""


FAILED_RELEASE = DESTROY_PRELUDE + """
for _ in range(2):   # the fake hands out the same handle again
    s = c_void_p()
    fake.cudaStreamCreate(byref(s))
    p = c_void_p()
    process.cudaMallocAsync(byref(p), 4096, s)
    process.cudaFreeAsync(p, s)
    out.setdefault("destroy_rcs", []).append(process.cudaStreamDestroy(s))
out["cuda_stream_destroys"] = counter("fake_cudart_stream_destroy_calls")
"""


@needs_fake
def test_a_failed_release_is_said_once_and_the_stream_is_destroyed_anyway(run_python):
    # tidepool holds memory for the handle, which its host backend cannot wait for: the
    # release fails, as for a handle the program had already destroyed.
    out, stderr = run_with_fake(run_python, FAILED_RELEASE, TIDEPOOL_BACKEND="host")
    assert out == {"destroy_rcs": [0, 0], "cuda_stream_destroys": 2}
    assert stderr.count("tidepool preload: cudaStreamDestroy: could not release the stream "
                        "in tidepool first (") == 1
    assert ("in tidepool first (tidepool host backend: stream_synchronize: unknown stream "
            "0x5200") in stderr
    assert "destroying it anyway" in stderr


@needs_fake
def test_a_failed_release_is_quiet_under_log_off(run_python):
    out, stderr = run_with_fake(run_python, FAILED_RELEASE, TIDEPOOL_BACKEND="host",
                                PYTORCH_CUDA_ALLOC_CONF="tidepool.log:off")
    assert out == {"destroy_rcs": [0, 0], "cuda_stream_destroys": 2}
    assert "cudaStreamDestroy" not in stderr


# Note [streams tidepool is given] in preload/tidepool_preload.cpp; STREAMS_PRELUDE
# (preload_fake.py) holds streams back with the host-streams helper's gate.


@needs_fake
@needs_host_streams
@pytest.mark.parametrize("freeing_stream", ["created", "null"])
def test_a_free_on_another_devices_stream_waits_for_that_stream(run_python, freeing_stream):
    # A device-1 block freed on a device-0 stream (a created one, or NULL with device 0
    # current): freed on device 1's allocator, and reusable only once the device-0 stream
    # has passed the free, not at once (as in the allocating stream's own order).
    out, stderr = run_with_fake(run_python, STREAMS_PRELUDE + f"""
on_device(1)
s1 = create_stream()
p = c_void_p()
if {freeing_stream!r} == "null":
    out["malloc_rc"] = process.cudaMalloc(byref(p), LARGE)
else:
    out["malloc_rc"] = process.cudaMallocAsync(byref(p), LARGE, s1)
on_device(0)
s0 = create_stream() if {freeing_stream!r} == "created" else c_void_p()
helper.host_streams_hold(s0, 0)
out["free_rc"] = process.cudaFreeAsync(p, s0)
out["allocated"] = [tidepool.stats(d)["allocated_bytes.all.current"] for d in (0, 1)]
on_device(1)
def allocate_on_device_1():
    q = c_void_p()
    if {freeing_stream!r} == "null":
        process.cudaMalloc(byref(q), LARGE)
    else:
        process.cudaMallocAsync(byref(q), LARGE, s1)
    return q.value
out["reused_while_held"] = allocate_on_device_1() == p.value
settle(0)
helper.host_streams_synchronize_device(1)
out["reused_once_passed"] = allocate_on_device_1() == p.value
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS)
    assert out == {"malloc_rc": 0, "free_rc": 0, "allocated": [4 << 20, 0],
                   "reused_while_held": False, "reused_once_passed": True}
    assert stderr == ""


@needs_fake
def test_a_free_on_another_devices_stream_that_cannot_be_ordered_loses_nothing(run_python):
    # Without the helper the fake's events fail (cudaErrorNotSupported): the free fails
    # with that error and the pointer stays the program's, freed later on its own stream.
    out, stderr = run_with_fake(run_python, DESTROY_PRELUDE + f"""
os.environ["FAKE_CUDART_STREAM_DEVICE"] = "1"
p = c_void_p()
out["malloc_rc"] = process.cudaMallocAsync(byref(p), 4096, c_void_p({STREAM}))
os.environ["FAKE_CUDART_STREAM_DEVICE"] = "0"
out["cross_device_free_rc"] = process.cudaFreeAsync(p, c_void_p({STREAM + 1}))
out["still_allocated"] = tidepool.stats(1)["allocated_bytes.all.current"]
os.environ["FAKE_CUDART_STREAM_DEVICE"] = "1"
out["free_rc"] = process.cudaFreeAsync(p, c_void_p({STREAM}))
out["allocated_after_free"] = tidepool.stats(1)["allocated_bytes.all.current"]
out["cuda_free_asyncs"] = counter("fake_cudart_free_async_calls")
""", TIDEPOOL_BACKEND="host")
    assert out == {"malloc_rc": 0, "cross_device_free_rc": 801, "still_allocated": 4096,
                   "free_rc": 0, "allocated_after_free": 0, "cuda_free_asyncs": 0}
    assert stderr == ""


@needs_fake
@needs_host_streams
def test_a_free_tidepool_fails_loses_nothing(run_python):
    # tidepool can neither record the free's event on the freeing stream (one its host
    # backend does not know) nor synchronise the device instead (work on the NULL stream
    # failed): the free fails and the block stays allocated (Note [Failed frees]). The
    # pointer stays the program's: freed again, it goes to tidepool, not to the runtime.
    out, stderr = run_with_fake(run_python, STREAMS_PRELUDE + f"""
helper.host_streams_fail.argtypes = [ctypes.c_void_p, ctypes.c_int]
allocated = lambda: tidepool.stats(0)["allocated_bytes.all.current"] - (4 << 20)
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), LARGE)
out["fail_rc"] = helper.host_streams_fail(None, 0)
out["failed_free_rc"] = process.cudaFreeAsync(p, c_void_p({STREAM}))
out["still_allocated"] = allocated()
out["free_rc"] = process.cudaFree(p)    # the failure was reported once: the device is sound
out["allocated_after_free"] = allocated()
out["cuda_frees"] = counter("fake_cudart_free_calls")
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS)
    assert out == {"malloc_rc": 0, "fail_rc": 0, "failed_free_rc": 1,  # cudaErrorInvalidValue
                   "still_allocated": 4 << 20, "free_rc": 0, "allocated_after_free": 0,
                   "cuda_frees": 0}
    assert "the block is still allocated" in stderr
    assert "injected failure (host_streams_fail)" in stderr


@needs_fake
def test_cuda_free_on_a_device_it_cannot_make_current_loses_nothing(run_python):
    # cudaFree must synchronise the block's device; when it cannot make it current it
    # fails and keeps the block (the fake knows devices 0 to 3 only; tidepool's host
    # backend has more).
    out, _ = run_with_fake(run_python, DESTROY_PRELUDE + """
os.environ["FAKE_CUDART_DEVICE"] = "5"
p = c_void_p()
out["malloc_rc"] = process.cudaMalloc(byref(p), 4096)
os.environ["FAKE_CUDART_DEVICE"] = "0"
out["free_elsewhere_rc"] = process.cudaFree(p)
out["still_allocated"] = tidepool.stats(5)["allocated_bytes.all.current"]
os.environ["FAKE_CUDART_DEVICE"] = "5"
out["free_rc"] = process.cudaFree(p)
out["allocated_after_free"] = tidepool.stats(5)["allocated_bytes.all.current"]
""", TIDEPOOL_BACKEND="host")
    assert out == {"malloc_rc": 0,
                   "free_elsewhere_rc": 101,  # cudaErrorInvalidDevice
                   "still_allocated": 4096,
                   "free_rc": 0, "allocated_after_free": 0}


@needs_fake
@needs_host_streams
def test_the_legacy_and_per_thread_handles_are_not_streams_of_their_own(run_python):
    # cudaStreamLegacy is the NULL stream; cudaStreamPerThread a different stream in each
    # thread: tidepool gets no pools keyed by either.
    out, stderr = run_with_fake(run_python, STREAMS_PRELUDE + """
import threading
streams = lambda: sorted({seg["stream"] for seg in tidepool.snapshot(0)["segments"]} |
                         {b["stream"] for seg in tidepool.snapshot(0)["segments"]
                          for b in seg["blocks"]})
legacy, per_thread = c_void_p(1), c_void_p(2)
p = c_void_p()
out["legacy_malloc_rc"] = process.cudaMallocAsync(byref(p), LARGE, legacy)
out["legacy_free_rc"] = process.cudaFreeAsync(p, legacy)
q = c_void_p()
process.cudaMallocAsync(byref(q), LARGE, None)
out["legacy_block_is_nulls_at_once"] = q.value == p.value
process.cudaFreeAsync(q, None)
def first_thread():   # frees on its own per-thread stream, held back
    r = c_void_p()
    out["per_thread_malloc_rc"] = process.cudaMallocAsync(byref(r), LARGE, per_thread)
    helper.host_streams_hold(per_thread, 0)
    out["per_thread_free_rc"] = process.cudaFreeAsync(r, per_thread)
    out["r"] = r.value
def second_thread():  # its per-thread stream is another stream
    t = c_void_p()
    process.cudaMallocAsync(byref(t), LARGE, per_thread)
    out["t"] = t.value
for body in (first_thread, second_thread):
    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
out["reused_by_another_thread_while_held"] = out.pop("t") == out["r"]
settle(0)
u = c_void_p()
process.cudaMallocAsync(byref(u), LARGE, per_thread)
out["reused_once_passed"] = u.value == out.pop("r")
out["streams"] = streams()
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS)
    assert out == {"legacy_malloc_rc": 0, "legacy_free_rc": 0,
                   "legacy_block_is_nulls_at_once": True,
                   "per_thread_malloc_rc": 0, "per_thread_free_rc": 0,
                   "reused_by_another_thread_while_held": False, "reused_once_passed": True,
                   "streams": ["0x0"]}
    assert stderr == ""


@needs_fake
@needs_host_streams
def test_a_reused_stream_handle_starts_afresh(run_python):
    # Note [destroyed streams]: the fake hands the destroyed stream's handle to the next
    # cudaStreamCreate. What tidepool kept for the old stream is not the new one's: the
    # handle names nothing, and the old stream's free block comes to the new stream as
    # another stream's (a cross-stream reuse), not from a pool of its own.
    out, stderr = run_with_fake(run_python, STREAMS_PRELUDE + """
s = create_stream()
p, kept = c_void_p(), c_void_p()
process.cudaMallocAsync(byref(p), 4096, s)
process.cudaMallocAsync(byref(kept), 4096, s)   # keeps the segment from going back
process.cudaFreeAsync(p, s)          # cached for s
out["destroy_rc"] = process.cudaStreamDestroy(s)
t = create_stream()
out["same_handle"] = t.value == s.value
out["named"] = names(t)
reuses = tidepool.stats(0)["num_cross_stream_reuses"]
q = c_void_p()
process.cudaMallocAsync(byref(q), 4096, t)
out["reused"] = q.value == p.value
out["as_another_streams"] = tidepool.stats(0)["num_cross_stream_reuses"] - reuses
out["frees_rc"] = [process.cudaFreeAsync(kept, t), process.cudaFreeAsync(q, t)]
""", TIDEPOOL_BACKEND="host", HOST_STREAMS=HOST_STREAMS, FAKE_CUDART_REUSE_HANDLES="1")
    assert out == {"destroy_rc": 0, "same_handle": True, "named": False, "reused": True,
                   "as_another_streams": 1, "frees_rc": [0, 0]}
    assert stderr == ""
