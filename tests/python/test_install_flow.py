"""What installation does inside torch, on a machine without a GPU: torch's CUDA entry
points are replaced by recorders (fake_torch_cuda.py: device_count -> 4), so the test
sees exactly which allocator is registered, when the MemPool is made, which of torch's
functions are replaced, and what record_stream and the memory figures reach. The
optimizer step hooks have their own file, test_optim_hooks.py."""

from __future__ import annotations

import ctypes
import os
import threading
import time
import warnings
from types import SimpleNamespace

import pytest
import torch

from tidepool import _config, _install, _lib, _record_stream, _stats, _tags
import tidepool

import fake_torch_cuda
from fake_torch_cuda import fake_cuda, install  # noqa: F401  (a fixture, and the install)

REAL_LOAD_TORCH_CUDA = _lib.load_torch_cuda  # before fake_cuda replaces it


def test_global_mode_prefers_libtidepool_torch_cuda(fake_cuda, monkeypatch):
    # It connects cacheInfo, record_stream and the memory statistics in C++: no Python
    # record_stream wrapper, no replaced torch.cuda memory functions, no torch
    # CUDAPluggableAllocator object, no fallback warning.
    swaps = []
    shim = SimpleNamespace(tidepool_torch_install_cuda_allocator=lambda: swaps.append(1) or 0)
    monkeypatch.setattr(_lib, "load_torch_cuda", lambda: (shim, ""))
    monkeypatch.setattr(_lib, "torch_cuda_library_path", lambda: "/lib/libtidepool_torch_cuda.so")
    original = torch.Tensor.record_stream
    with warnings.catch_warnings():
        warnings.simplefilter("error", _install.TidepoolFallbackWarning)
        install()
    assert swaps == [1]
    assert fake_cuda == [], "torch's CUDAPluggableAllocator is neither made nor installed"
    assert torch.Tensor.record_stream is original and _install.STATE.record_stream is None
    assert _install.STATE.torch_memory is None
    assert _install.STATE.cuda_allocator == "/lib/libtidepool_torch_cuda.so"
    assert tidepool.status() == "active: mode global"


def test_a_refused_swap_is_an_error_with_tidepools_message(fake_cuda, monkeypatch):
    shim = SimpleNamespace(tidepool_torch_install_cuda_allocator=lambda: -1)
    monkeypatch.setattr(_lib, "load_torch_cuda", lambda: (shim, ""))
    monkeypatch.setattr(_lib, "last_error", lambda: "Can't swap an already initialized allocator")
    with pytest.raises(RuntimeError,
                       match="already initialized allocator.*before CUDA is first used"):
        install()
    assert fake_cuda == []


def test_a_torch_cuda_library_that_is_not_there_is_a_library_error(fake_cuda, monkeypatch):
    # Review finding: TIDEPOOL_TORCH_CUDA_LIBRARY naming no file came out as a plain
    # RuntimeError saying tidepool must be installed before CUDA is first used.
    monkeypatch.setattr(_lib, "load_torch_cuda", REAL_LOAD_TORCH_CUDA)
    monkeypatch.setenv("TIDEPOOL_TORCH_CUDA_LIBRARY", "/nonexistent/libtidepool_torch_cuda.so")
    with pytest.raises(_lib.LibraryError, match="TIDEPOOL_TORCH_CUDA_LIBRARY=.*is not a file") \
            as caught:
        install()
    assert "before CUDA is first used" not in str(caught.value)
    assert fake_cuda == []
    assert tidepool.status().startswith("failed: TIDEPOOL_TORCH_CUDA_LIBRARY=")
    assert _install.STATE.torch is None  # nothing installed: a fixed variable may retry


def test_without_libtidepool_torch_cuda_global_mode_falls_back_and_says_why(fake_cuda):
    config = _config.claim("backend:tidepool").config
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "device_count", lambda: 1)
        with pytest.warns(_install.TidepoolFallbackWarning,
                          match="test: no libtidepool_torch_cuda.*cudnn.benchmark"):
            _install.install(torch, config)
    assert [c[0] for c in fake_cuda] == ["pluggable", "change_current_allocator"]
    assert _install.STATE.cuda_allocator == "torch.cuda.memory.CUDAPluggableAllocator"
    assert tidepool.TidepoolFallbackWarning is _install.TidepoolFallbackWarning


def test_a_fallback_warning_made_an_error_comes_after_a_complete_install(fake_cuda):
    # With warnings as errors (pytest's filterwarnings = error) the warning raises; the
    # installation it reports on must be whole by then, not stopped after the allocator.
    config = _config.claim("backend:tidepool").config
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        warnings.simplefilter("error", _install.TidepoolFallbackWarning)
        patch.setattr(torch.cuda, "device_count", lambda: 1)
        with pytest.raises(_install.TidepoolFallbackWarning):
            _install.install(torch, config)
    assert _install.STATE.active
    assert tidepool.status() == "active: mode global"
    assert _install.STATE.optimizer_hooks is not None
    assert _install.STATE.torch_memory is not None


def test_a_failed_install_says_so_in_the_status(fake_cuda, monkeypatch):
    shim = SimpleNamespace(tidepool_torch_install_cuda_allocator=lambda: -1)
    monkeypatch.setattr(_lib, "load_torch_cuda", lambda: (shim, ""))
    monkeypatch.setattr(_lib, "last_error", lambda: "Can't swap an already initialized allocator")
    with pytest.raises(RuntimeError):
        install()
    assert tidepool.status().startswith("failed: cannot install the allocator")
    assert not _install.STATE.active
    assert _install.STATE.torch is None  # nothing was installed: a later install may try again


def test_a_failure_after_the_allocator_is_in_place_says_what_is_installed(fake_cuda, monkeypatch):
    from tidepool import _optim_hooks

    def failing_register(torch):
        raise RuntimeError("no step hooks in this torch")

    monkeypatch.setattr(_optim_hooks, "register", failing_register)
    with pytest.raises(RuntimeError, match="no step hooks"):
        install(mode="pool")
    assert tidepool.status() == ("failed: the allocator is installed (mode pool) but the optimizer "
                                 "step hooks are not: no step hooks in this torch")
    assert not _install.STATE.active


def test_the_device_argument_accepts_what_torch_accepts():
    assert tidepool._device(3) == 3
    assert tidepool._device("cuda:1") == 1
    assert tidepool._device(torch.device("cuda", 2)) == 2
    assert tidepool._device(None) == 0  # inactive: device 0
    assert tidepool._device("cuda") == 0
    with pytest.raises(ValueError, match="cpu is not a CUDA device"):
        tidepool._device("cpu")


def test_without_an_install_torchs_cuda_gives_the_current_device_and_stream(monkeypatch):
    # Under the LD_PRELOAD shim nothing is installed in Python, but torch has initialised
    # CUDA on its own device (torchrun's rank 2 on cuda:2): evict() and stats() default to
    # that device, and evict() waits for the work queued on its current stream.
    from tidepool import _tiering
    monkeypatch.setattr(_install, "STATE", _install._State())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: SimpleNamespace(cuda_stream=1000 + device))
    synchronized = []
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda handle, device: SimpleNamespace(
        synchronize=lambda: synchronized.append((handle, device))))
    calls = []
    monkeypatch.setattr(_tiering, "_fn",
                        lambda name: lambda *args: calls.append((name, *args[:3])) or 0)
    # A range of the tag on the device: there is something to evict, so it waits first.
    monkeypatch.setattr(_tiering, "device_ranges_except", lambda device, tag, ptrs: [0x1000])
    tidepool.evict()
    tidepool.prefetch()
    assert synchronized == [(1002, 2)]
    assert calls == [("tidepool_evict_tag", 2, _tags.OPTIMIZER_STATE),
                     ("tidepool_prefetch_tag_within_budget", 2, _tags.OPTIMIZER_STATE, 1002)]
    assert tidepool._device("cuda") == 2


def test_the_install_at_import_torch_does_not_initialise_the_cuda_driver(fake_cuda,
                                                                        monkeypatch):
    # torch.cuda.is_available() calls cudaGetDeviceCount (cuInit) unless told to use NVML;
    # after cuInit a forked child cannot use CUDA, so a launcher that imports torch and
    # forks its GPU workers broke as soon as tidepool was named. NVML answers here (no
    # device, as on this machine) and the runtime's count must not be asked.
    asked = []
    monkeypatch.setattr(torch.cuda, "device_count", fake_torch_cuda.REAL_DEVICE_COUNT)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 0)
    monkeypatch.setattr(torch.cuda, "_cached_device_count", None)
    monkeypatch.setattr(torch._C, "_cuda_getDeviceCount", lambda: asked.append(1) or 0)
    with pytest.warns(_install.TidepoolInactiveWarning, match="no CUDA device"):
        _install.install(torch, _config.claim("backend:tidepool").config)
    assert asked == []
    assert tidepool.status().startswith("inactive: no CUDA device")


def test_install_takes_one_call_at_a_time(fake_cuda, monkeypatch):
    """Review finding: two threads installing two configurations both got through (one's
    mode in Python, the other's budgets in libtidepool). The second waits for the first
    and is refused: tidepool is installed, with another configuration."""
    real_apply = _config.apply
    entered = threading.Event()

    def slow_apply(conf):
        entered.set()
        time.sleep(0.2)  # the other thread's call comes in meanwhile
        return real_apply(conf)
    monkeypatch.setattr(_config, "apply", slow_apply)
    outcomes = {}

    def run(name, conf):
        try:
            outcomes[name] = tidepool.install(conf)
        except _config.ConfigError as e:
            outcomes[name] = e
    first = threading.Thread(target=run, args=("first", "backend:tidepool,tidepool.log:off"))
    first.start()
    entered.wait()
    run("second", "backend:tidepool,tidepool.log:off,tidepool.state_budget:1GiB")
    first.join()
    assert isinstance(outcomes["first"], str)
    assert isinstance(outcomes["second"], _config.ConfigError)
    assert "with another configuration" in str(outcomes["second"])


def test_install_under_the_preload_shim_reports_the_shim(fake_cuda, monkeypatch):
    # LD_PRELOAD=libtidepool_preload.so claimed the environment and serves cudaMalloc; a
    # script that also calls tidepool.install() must not be told tidepool is not named.
    from tidepool import _startup
    monkeypatch.setattr(_startup, "preload_shim_in_charge", lambda: True)
    assert tidepool.install() == "active: through the LD_PRELOAD shim (libtidepool_preload.so)"
    assert not [c for c in fake_cuda if c[0] in ("pluggable", "change_current_allocator")]


def test_the_fallback_is_silent_with_log_off(fake_cuda):
    with warnings.catch_warnings():
        warnings.simplefilter("error", _install.TidepoolFallbackWarning)
        config = _config.claim("backend:tidepool,tidepool.log:off").config
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.cuda, "device_count", lambda: 1)
            _install.install(torch, config)
    assert _install.STATE.cuda_allocator == "torch.cuda.memory.CUDAPluggableAllocator"


@pytest.mark.skipif(not os.environ.get("TIDEPOOL_TORCH_CUDA_LIBRARY"),
                    reason="no libtidepool_torch_cuda.so in this build (CUDA builds only)")
def test_libtidepool_torch_cuda_is_used_only_under_the_torch_it_was_built_against(monkeypatch):
    # Note [one torch for libtidepool_torch_cuda]: under another torch its symbols may all
    # resolve while c10 calls the wrong virtual methods; the fallback is taken instead.
    shim, why = _lib.load_torch_cuda()
    assert shim is not None, why
    built = torch.__version__.split("+")[0]
    monkeypatch.setattr(torch, "__version__", "9.9.9+cu999")
    shim, why = _lib.load_torch_cuda()
    assert shim is None
    assert f"was built against torch {built}, but this is torch 9.9.9" in why


@pytest.mark.skipif(not os.environ.get("TIDEPOOL_TORCH_CUDA_LIBRARY"),
                    reason="no libtidepool_torch_cuda.so in this build (CUDA builds only)")
def test_the_real_libtidepool_torch_cuda_becomes_c10s_allocator(run_python):
    # In a fresh interpreter (the swap is for the life of the process), with torch told a
    # device is there: c10's CUDA allocator is no longer the native one, and the Python
    # record_stream wrapper is not needed.
    result = run_python(
        """
        import torch
        torch.cuda.device_count = lambda: 1
        from tidepool import _config, _install
        before = torch.cuda.memory.get_allocator_backend()
        original = torch.Tensor.record_stream
        _install.install(torch,
                         _config.claim("backend:tidepool,tidepool.optimizer_hooks:off").config)
        print("BEFORE", before, "AFTER", torch.cuda.memory.get_allocator_backend())
        print("WRAPPED", torch.Tensor.record_stream is not original)
        print("VIA", _install.STATE.cuda_allocator)
        # torch.cuda's memory functions reach tidepool through c10 (getDeviceStats and the
        # resets), with none of them replaced in Python.
        import ctypes
        from tidepool import _lib, _stats
        torch.cuda.memory.is_initialized = lambda: True
        lib = _lib.load()
        ptr = lib.tidepool_malloc(5 << 20, 0, None)
        raw = _stats.raw_stats(0)
        stats = torch.cuda.memory_stats(0)
        print("ALLOCATED", stats["allocated_bytes.all.current"] == raw.allocated.current >= 5 << 20)
        print("PEAK", stats["allocation.all.peak"] == raw.allocations.peak >= 1)
        print("SMALL", stats["allocated_bytes.small_pool.current"] == 0)
        torch.cuda.reset_accumulated_memory_stats(0)
        lib.tidepool_free(ctypes.c_void_p(ptr), 5 << 20, 0, None)
        after = torch.cuda.memory_stats(0)
        print("RESET",
              after["allocation.all.allocated"] == 0 and after["allocation.all.freed"] == 1)
        torch.cuda.reset_peak_memory_stats(0)
        print("PEAK_RESET", torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0))
        print("PATCHED", torch.cuda.memory.memory_stats_as_nested_dict.__module__)
        # The fallback's ctypes mirror reads the same struct c10 is filled from.
        from tidepool import _torch_memory
        print("SAME_AS_FALLBACK", torch.cuda.memory.memory_stats_as_nested_dict(0)
              == _torch_memory.nested_stats(0))
        # The memory visualizer's snapshot comes from tidepool's backed ranges through c10.
        import os, pickle, tempfile
        held = lib.tidepool_malloc(3 << 20, 0, None)
        snap = torch.cuda.memory._snapshot()
        blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
        print("SNAPSHOT", any(b["address"] == held and b["state"] == "active_allocated"
                              and b["requested_size"] == 3 << 20 for b in blocks),
              sum(seg["total_size"] for seg in snap["segments"])
              == _stats.raw_stats(0).reserved.current,
              len(torch.cuda.memory_snapshot()) == len(snap["segments"]))
        path = os.path.join(tempfile.mkdtemp(), "snapshot.pickle")
        torch.cuda.memory._dump_snapshot(path)
        with open(path, "rb") as f:
            print("DUMPED", sorted(pickle.load(f)) == sorted(snap))
        print("HISTORY", torch._C._cuda_isHistoryEnabled())
        lib.tidepool_free(ctypes.c_void_p(held), 3 << 20, 0, None)
        """,
        hook_first=False,
        TIDEPOOL_TORCH_CUDA_LIBRARY=os.environ["TIDEPOOL_TORCH_CUDA_LIBRARY"])
    assert "BEFORE native AFTER pluggable" in result.stdout, result.stdout + result.stderr
    assert "WRAPPED False" in result.stdout
    assert "VIA " + os.environ["TIDEPOOL_TORCH_CUDA_LIBRARY"] in result.stdout
    assert "TidepoolFallbackWarning" not in result.stderr
    for line in ("ALLOCATED True", "PEAK True", "SMALL True", "RESET True", "PEAK_RESET True",
                 "PATCHED torch.cuda.memory", "SAME_AS_FALLBACK True", "SNAPSHOT True True True",
                 "DUMPED True",
                 "HISTORY False"):
        assert line in result.stdout, result.stdout + result.stderr


def test_global_mode_replaces_the_current_allocator(fake_cuda):
    install()
    allocator = _install.STATE.allocator
    assert fake_cuda == [("pluggable", _lib.library_path(), "tidepool_pytorch_malloc",
                          "tidepool_pytorch_free"),
                         ("change_current_allocator", allocator)]
    assert tidepool.status() == "active: mode global"
    assert len(_install.STATE.optimizer_hooks) == 3  # step pre/post hooks, load_state_dict
    assert _install.pool() is None
    install()  # a second install is a no-op
    assert len(fake_cuda) == 2


def test_pytorch_is_handed_the_library_already_loaded(fake_cuda, monkeypatch, tmp_path):
    # Review finding: the path was looked up again, so a TIDEPOOL_LIBRARY changed after the
    # package loaded its copy (or a relative one after a chdir) handed PyTorch a second
    # libtidepool, with the default configuration and none of the package's tag pushes.
    loaded = _lib.load()._name
    other = tmp_path / "libtidepool.so"
    other.write_bytes(b"not loaded")
    monkeypatch.setenv("TIDEPOOL_LIBRARY", str(other))
    assert _lib.library_path() == loaded
    install(mode="pool")
    assert fake_cuda[0][1] == loaded


def test_pool_mode_keeps_pytorchs_allocator_and_makes_the_pool_on_first_use(fake_cuda):
    install(mode="pool")
    # Review finding: the pool got the throwing pair. PyTorch checks a MemPool allocator's
    # NULL (allocPrimitive), frees its own cache, retries and raises torch.OutOfMemoryError;
    # the throw skipped all of that.
    assert fake_cuda == [("pluggable", _lib.library_path(), "tidepool_pytorch_pool_malloc",
                          "tidepool_pytorch_free")]
    pool = _install.pool()
    assert _install.pool() is pool
    assert fake_cuda[1] == ("mempool", _install.STATE.allocator.handle)
    assert len(fake_cuda) == 2


def test_a_tag_name_with_a_nul_byte_is_refused():
    # Review finding: ctypes passed "a\0b" on as "a", so the name made or found tag "a".
    before = [_tags.tag_name(i) for i in range(_tags.TAG_MAX)]
    for call in (_tags.tag_id, _tags.existing_tag_id):
        with pytest.raises(ValueError, match="NUL byte"):
            call("nul\0tag")
    assert [_tags.tag_name(i) for i in range(_tags.TAG_MAX)] == before


def test_region_tags_and_in_pool_mode_routes_to_the_pool(fake_cuda):
    install(mode="pool")
    outside = _tags.current()
    with tidepool.region("activations_of_block_3") as tag:
        assert _tags.current() == tag
        assert _tags.tag_name(tag) == "activations_of_block_3"
        assert fake_cuda[-1] == ("enter_pool", 0)  # the current device, by its index
    assert _tags.current() == outside
    assert fake_cuda[-1] == ("exit_pool", 0)


def test_region_routes_every_device_it_names_to_the_pool(fake_cuda):
    install(mode="pool")
    with tidepool.region("optimizer_state", device=[1, torch.device("cuda", 0), 1]):
        assert [c for c in fake_cuda if c[0] == "enter_pool"] == [("enter_pool", 1),
                                                                   ("enter_pool", 0)]
    assert fake_cuda[-2:] == [("exit_pool", 0), ("exit_pool", 1)]
    # Note [a MemPool per device]: each device's pool was made with that device current.
    state = _tags.OPTIMIZER_STATE  # Note [a MemPool per tag]: pools keyed by (device, tag)
    assert {key: [p.device for p in pools] for key, pools in _install.STATE.pools.items()} == {
        (1, state): [1], (0, state): [0]}
    assert _install.pool(1) is _install.STATE.pools[(1, state)][0]
    with tidepool.region("optimizer_state", device=2):
        assert fake_cuda[-1] == ("enter_pool", 2)
    with tidepool.region("optimizer_state", device=torch.device("cuda")):  # the current one
        assert fake_cuda[-1] == ("enter_pool", 0)
    # Strings as torch takes them (review finding: "cuda:1" was refused, against the README).
    with tidepool.region("optimizer_state", device="cuda:1"):
        assert fake_cuda[-1] == ("enter_pool", 1)
    with tidepool.region("optimizer_state", device="cuda"):
        assert fake_cuda[-1] == ("enter_pool", 0)
    for bad in (-1, "cpu", "cuda:x", "", torch.device("cpu"), [], [0, None], True):
        before = list(fake_cuda)
        with pytest.raises(ValueError, match="tidepool.region: device"):
            with tidepool.region("optimizer_state", device=bad):
                pass
        assert fake_cuda == before  # nothing entered, no tag left pushed
        assert _tags.current() != _tags.OPTIMIZER_STATE


@pytest.mark.parametrize("mode", ["global", "pool"])
def test_region_refuses_a_device_the_process_does_not_have(fake_cuda, mode):
    # Review finding: in global mode region(device=7) on a machine with fewer GPUs was
    # taken silently (nothing looked at the index); in pool mode torch's own error came
    # from deep inside use_mem_pool. The fake machine has four devices.
    install(mode=mode)
    before = list(fake_cuda)
    for bad in (4, [0, 7], "cuda:4", torch.device("cuda", 5)):
        with pytest.raises(ValueError, match=r"device \d does not exist: this process sees "
                                             r"4 CUDA devices \(0\.\.3\)"):
            with tidepool.region("optimizer_state", device=bad):
                pass
        assert fake_cuda == before  # nothing entered, no tag left pushed
        assert _tags.current() != _tags.OPTIMIZER_STATE
    with tidepool.region("optimizer_state", device=3):
        assert _tags.current() == _tags.OPTIMIZER_STATE


def test_region_checks_the_devices_torch_sees_now(fake_cuda, monkeypatch):
    """CUDA_VISIBLE_DEVICES may change after `import torch` (a launcher narrowing it per
    rank): the count taken at the install let a device that no longer exists pass."""
    install()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"device 3 does not exist: this process sees 1 CUDA "
                                         r"device"):
        with tidepool.region("optimizer_state", device=3):
            pass


def test_host_backend_cannot_back_cuda_tensors(fake_cuda):
    with pytest.warns(_install.TidepoolInactiveWarning, match="device_backend:host"):
        install(device_backend="host")
    assert fake_cuda == []
    assert tidepool.status().startswith("inactive: tidepool.device_backend:host")


def test_tidepool_backend_host_in_the_environment_cannot_back_cuda_tensors(fake_cuda,
                                                                         monkeypatch):
    # Review finding: with device_backend auto, libtidepool follows TIDEPOOL_BACKEND, and
    # host memory went to PyTorch as CUDA memory (a variable left exported from the tests).
    monkeypatch.setenv("TIDEPOOL_BACKEND", "host")
    with pytest.warns(_install.TidepoolInactiveWarning, match="TIDEPOOL_BACKEND=host"):
        install()
    assert fake_cuda == []
    assert tidepool.status().startswith("inactive: TIDEPOOL_BACKEND=host")


def test_optimizer_hooks_off_registers_none(fake_cuda):
    install(optimizer_hooks="off")
    assert _install.STATE.optimizer_hooks is None


def test_global_mode_connects_record_stream(fake_cuda):
    original = torch.Tensor.record_stream
    install()
    wrapped = torch.Tensor.record_stream
    assert wrapped is not original and wrapped.__wrapped__ is original
    _install.STATE.record_stream.remove()
    assert torch.Tensor.record_stream is original


def test_pool_mode_leaves_record_stream_to_pytorchs_allocator(fake_cuda):
    original = torch.Tensor.record_stream
    install(mode="pool")
    assert torch.Tensor.record_stream is original
    assert _install.STATE.record_stream is None


MEMORY_FUNCTIONS = ("memory_stats_as_nested_dict", "reset_peak_memory_stats",
                    "reset_accumulated_memory_stats", "empty_cache",
                    "set_per_process_memory_fraction", "get_per_process_memory_fraction")


ACCELERATOR_MEMORY_FUNCTIONS = ("memory_stats", "reset_peak_memory_stats",
                                "reset_accumulated_memory_stats", "empty_cache")


def test_global_mode_answers_torch_cuda_memory_functions_and_pool_mode_leaves_them(fake_cuda):
    originals = {name: getattr(torch.cuda.memory, name) for name in MEMORY_FUNCTIONS}
    accelerator_originals = {name: getattr(torch.accelerator.memory, name)
                             for name in ACCELERATOR_MEMORY_FUNCTIONS}
    install(mode="pool")
    assert all(getattr(torch.cuda.memory, n) is f for n, f in originals.items())
    for handle in _install.STATE.optimizer_hooks:
        handle.remove()
    _install.STATE = _install._State()
    install()
    for name, original in originals.items():
        assert getattr(torch.cuda.memory, name) is not original
        assert getattr(torch.cuda, name) is getattr(torch.cuda.memory, name)
        assert getattr(torch.cuda.memory, name).__wrapped__ is original
    for name, original in accelerator_originals.items():  # torch.accelerator's faces of them
        assert getattr(torch.accelerator.memory, name).__wrapped__ is original
        assert getattr(torch.accelerator, name) is getattr(torch.accelerator.memory, name)
    _install.STATE.torch_memory.remove()
    assert all(getattr(torch.cuda.memory, n) is f and getattr(torch.cuda, n) is f
               for n, f in originals.items())
    assert all(getattr(torch.accelerator.memory, n) is f and getattr(torch.accelerator, n) is f
               for n, f in accelerator_originals.items())


def test_torch_cuda_memory_figures_come_from_tidepool(fake_cuda, monkeypatch):
    # On the host backend, with torch believing CUDA is initialised: what a training
    # script's memory logging calls, through PyTorch's own functions above ours.
    install()
    for module in (torch.cuda, torch.cuda.memory):  # memory.py holds its own binding
        monkeypatch.setattr(module, "is_initialized", lambda: True)
    emptied = []
    monkeypatch.setattr(torch._C, "_cuda_emptyCache", lambda: emptied.append(True))
    lib = _lib.load()
    size = 3 << 20
    ptr = lib.tidepool_malloc(size, 0, None)
    assert ptr, _lib.last_error()
    try:
        raw = _stats.raw_stats(0)
        assert torch.cuda.memory_allocated(0) == raw.allocated.current >= size
        assert torch.cuda.max_memory_allocated(0) == raw.allocated.peak
        assert torch.cuda.memory_reserved(0) == raw.reserved.current >= size
        assert torch.cuda.max_memory_reserved(0) == raw.reserved.peak
        stats = torch.cuda.memory_stats(0)
        assert stats["allocation.all.current"] == raw.alloc_count - raw.free_count
        assert stats["allocation.all.peak"] == raw.allocations.peak >= 1
        assert stats["segment.all.current"] == raw.segments.current
        assert stats["allocated_bytes.small_pool.current"] == 0
        assert stats["allocated_bytes.large_pool.current"] == raw.allocated.current
        assert stats["num_ooms"] == raw.oom_count
        assert "Allocated memory" in torch.cuda.memory_summary(0)
        # torch.accelerator's device-generic functions give the same figures.
        assert torch.accelerator.memory_allocated(0) == raw.allocated.current
        assert torch.accelerator.max_memory_reserved(0) == raw.reserved.peak
        assert torch.accelerator.memory_stats(0)["allocation.all.peak"] == raw.allocations.peak
    finally:
        lib.tidepool_free(ctypes.c_void_p(ptr), size, 0, None)
    torch.cuda.reset_peak_memory_stats(0)
    assert torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0)
    reserved = torch.cuda.memory_reserved(0)
    torch.cuda.empty_cache()
    assert emptied == [True], "PyTorch's own empty_cache still runs"
    assert torch.cuda.memory_reserved(0) <= reserved - size


def test_reset_accumulated_memory_stats_counts_the_totals_from_the_call_on(fake_cuda,
                                                                          monkeypatch):
    install()
    for module in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(module, "is_initialized", lambda: True)
    lib = _lib.load()
    size = 1 << 20
    held = lib.tidepool_malloc(size, 0, None)
    passing = lib.tidepool_malloc(size, 0, None)
    assert held and passing, _lib.last_error()
    lib.tidepool_free(ctypes.c_void_p(passing), size, 0, None)
    fresh = None
    try:
        before = torch.cuda.memory_stats(0)
        assert before["allocation.all.allocated"] >= 2
        totals_before = _stats.raw_stats(0).alloc_count
        torch.cuda.reset_accumulated_memory_stats(0)
        after = torch.cuda.memory_stats(0)
        for key in ("allocation.all.allocated", "allocation.all.freed",
                    "allocated_bytes.all.allocated", "allocated_bytes.all.freed",
                    "reserved_bytes.all.allocated", "segment.all.allocated",
                    "num_device_alloc", "num_ooms", "num_alloc_retries"):
            assert after[key] == 0, key
        for key in ("allocation.all.current", "allocated_bytes.all.current",
                    "allocated_bytes.all.peak", "reserved_bytes.all.current"):
            assert after[key] == before[key], key
        fresh = lib.tidepool_malloc(size, 0, None)
        assert fresh, _lib.last_error()
        counted = torch.cuda.memory_stats(0)
        assert counted["allocation.all.allocated"] == 1
        assert counted["allocated_bytes.all.allocated"] == (
            counted["allocated_bytes.all.current"] - after["allocated_bytes.all.current"])
        # tidepool's own totals are not reset.
        assert _stats.raw_stats(0).alloc_count == totals_before + 1
    finally:
        lib.tidepool_free(ctypes.c_void_p(held), size, 0, None)
        if fresh:
            lib.tidepool_free(ctypes.c_void_p(fresh), size, 0, None)


def test_the_memory_fraction_caps_tidepool(fake_cuda, monkeypatch):
    # torch's CUDAPluggableAllocator class ignores set_per_process_memory_fraction and
    # raises for the getter; in global mode both reach tidepool (after PyTorch's checks).
    install()
    reached_c10 = []
    monkeypatch.setattr(torch.cuda.memory, "_lazy_init", lambda: None)
    monkeypatch.setattr(torch._C, "_cuda_setMemoryFraction",
                        lambda fraction, device: reached_c10.append((fraction, device)))
    try:
        torch.cuda.set_per_process_memory_fraction(0.5, 0)
        assert reached_c10 == [(0.5, 0)], "PyTorch's own path still runs"
        assert _lib.load().tidepool_get_memory_fraction(0) == 0.5
        assert torch.cuda.get_per_process_memory_fraction(0) == 0.5
        with pytest.raises(ValueError, match="Allowed range"):
            torch.cuda.set_per_process_memory_fraction(2.0, 0)
        assert torch.cuda.get_per_process_memory_fraction(0) == 0.5
    finally:
        assert _lib.load().tidepool_set_memory_fraction(1.0, 0) == 0
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0


def test_before_cuda_is_initialised_the_stats_are_empty_as_in_pytorch(fake_cuda, monkeypatch):
    install()
    for module in (torch.cuda, torch.cuda.memory):
        monkeypatch.setattr(module, "is_initialized", lambda: False)
    assert torch.cuda.memory.memory_stats_as_nested_dict(0) == {}
    assert torch.cuda.memory_allocated(0) == 0


def fake_tensor(ptr, cuda=True):
    return SimpleNamespace(is_cuda=cuda,
                           untyped_storage=lambda: SimpleNamespace(data_ptr=lambda: ptr))


def test_record_stream_hands_tidepool_the_storage_and_the_stream(monkeypatch):
    calls = []

    def recorder(ptr, stream):
        calls.append((ptr.value, stream.value))
        return 0

    monkeypatch.setattr(_lib, "function", lambda name, what: recorder)
    stream = SimpleNamespace(cuda_stream=0x5000)
    _record_stream.record_in_tidepool(fake_tensor(0x1234), stream)
    _record_stream.record_in_tidepool(fake_tensor(0x1234, cuda=False), stream)  # not CUDA
    _record_stream.record_in_tidepool(fake_tensor(0), stream)  # empty storage
    assert calls == [(0x1234, 0x5000)]


def test_record_stream_takes_generic_streams_and_wrapper_subclasses(monkeypatch):
    # torch.Stream (device-generic code: torch.accelerator.current_stream()) has no
    # cuda_stream, and a wrapper subclass (DTensor) no storage of its own: PyTorch's own
    # record_stream takes both, so the wrapper around it must not then raise.
    calls = []
    monkeypatch.setattr(_lib, "function",
                        lambda name, what: lambda ptr, stream: calls.append(
                            (ptr.value, stream.value)) or 0)

    class FakeCudaStream:  # torch.cuda.Stream needs a GPU to be made
        def __init__(self, stream_id, device_index, device_type):
            self.cuda_stream = 0x7000 + stream_id

    monkeypatch.setattr(torch.cuda, "Stream", FakeCudaStream)
    generic = torch.Stream(stream_id=3, device_index=0, device_type=1)
    _record_stream.record_in_tidepool(fake_tensor(0x1234), generic)

    class Wrapper:  # what DTensor's type has: __tensor_flatten__ naming its inner tensors
        is_cuda = True

        def __init__(self):
            self.local, self.scale = fake_tensor(0x2000), fake_tensor(0x3000)

        def __tensor_flatten__(self):
            return ["local", "scale"], None

    _record_stream.record_in_tidepool(Wrapper(), SimpleNamespace(cuda_stream=0x5000))
    assert calls == [(0x1234, 0x7003), (0x2000, 0x5000), (0x3000, 0x5000)]


def test_record_stream_of_memory_tidepool_did_not_hand_out_is_left_alone():
    # The real libtidepool (host backend): 1 for a foreign pointer, no exception; a
    # pointer it handed out is recorded (same stream here: a no-op that succeeds).
    outside = ctypes.create_string_buffer(64)
    stream = SimpleNamespace(cuda_stream=None)
    fn = _lib.function("tidepool_pytorch_record_stream", "record_stream for PyTorch")
    assert fn(ctypes.cast(outside, ctypes.c_void_p), None) == 1
    _record_stream.record_in_tidepool(fake_tensor(ctypes.addressof(outside)), stream)
    lib = _lib.load()
    ptr = lib.tidepool_malloc(1 << 20, 0, None)
    assert ptr, _lib.last_error()
    try:
        assert fn(ctypes.c_void_p(ptr), None) == 0
        _record_stream.record_in_tidepool(fake_tensor(ptr), stream)
    finally:
        lib.tidepool_free(ctypes.c_void_p(ptr), 1 << 20, 0, None)


def test_a_failed_record_stream_raises_with_tidepools_message(monkeypatch):
    monkeypatch.setattr(_lib, "function", lambda name, what: lambda ptr, stream: -1)
    monkeypatch.setattr(_lib, "last_error", lambda: "tidepool: the stream is gone")
    with pytest.raises(RuntimeError, match="record_stream failed: tidepool: the stream is gone"):
        _record_stream.record_in_tidepool(fake_tensor(0x10), SimpleNamespace(cuda_stream=0x20))


def test_a_library_without_the_pytorch_entry_points_is_a_clear_error(fake_cuda, monkeypatch):
    real_optional = _lib.optional
    monkeypatch.setattr(_lib, "optional",
                        lambda name: None if name == "tidepool_pytorch_malloc"
                        else real_optional(name))
    with pytest.raises(_lib.LibraryError, match="tidepool_pytorch_malloc is missing"):
        install()
    assert fake_cuda == []
