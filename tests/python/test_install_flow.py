"""What installation does inside torch, on a machine without a GPU: torch's CUDA entry
points are replaced by recorders (is_available -> True), so the test sees exactly which
allocator is registered, when the MemPool is made, and what the optimizer step hooks do
around a real torch.optim step (tags through the real libtidepool)."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import os
import warnings
from types import SimpleNamespace

import pytest
import torch

from tidepool import (_config, _install, _lib, _optim_hooks, _record_stream, _stats, _tags,
                      _tiering, _torch_memory)
import tidepool


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = []

    class FakePluggableAllocator:
        def __init__(self, path, alloc_fn, free_fn):
            calls.append(("pluggable", path, alloc_fn, free_fn))
            self.handle = object()

        def allocator(self):
            return self.handle

    class FakeMemPool:
        def __init__(self, allocator):
            calls.append(("mempool", allocator))

    @contextlib.contextmanager
    def fake_use_mem_pool(pool, device=None):
        calls.append(("enter_pool", device))
        yield
        calls.append(("exit_pool", device))

    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", FakePluggableAllocator)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator",
                        lambda allocator: calls.append(("change_current_allocator", allocator)))
    monkeypatch.setattr(torch.cuda, "MemPool", FakeMemPool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", fake_use_mem_pool)
    monkeypatch.setattr(_install, "STATE", _install._State())
    # Global mode through torch's CUDAPluggableAllocator class unless a test hands in a
    # libtidepool_torch_cuda (test_global_mode_prefers_libtidepool_torch_cuda): the real
    # one would swap c10's allocator in this process for good.
    monkeypatch.setattr(_lib, "load_torch_cuda", lambda: (None, "test: no libtidepool_torch_cuda"))
    yield calls
    for handle in _install.STATE.optimizer_hooks or ():
        handle.remove()
    if _install.STATE.record_stream is not None:
        _install.STATE.record_stream.remove()
    if _install.STATE.torch_memory is not None:
        _install.STATE.torch_memory.remove()


def install(**overrides) -> None:
    """_install.install with `overrides` as tidepool.* keys, while torch.cuda claims a
    device. Only for the install call: torch.optim consults is_available too, and torch's
    real CUDA calls behind it would crash on this GPU-less machine."""
    conf = ",".join(["backend:tidepool"] + [f"tidepool.{k}:{v}" for k, v in overrides.items()])
    with pytest.MonkeyPatch.context() as patch, warnings.catch_warnings():
        # What the fallback warns about has its own test.
        warnings.simplefilter("ignore", _install.TidepoolFallbackWarning)
        patch.setattr(torch.cuda, "is_available", lambda: True)
        _install.install(torch, _config.claim(conf).config)


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
    with pytest.raises(RuntimeError, match="already initialized allocator.*before CUDA is first used"):
        install()
    assert fake_cuda == []


def test_without_libtidepool_torch_cuda_global_mode_falls_back_and_says_why(fake_cuda):
    config = _config.claim("backend:tidepool").config
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: True)
        with pytest.warns(_install.TidepoolFallbackWarning,
                          match="test: no libtidepool_torch_cuda.*cudnn.benchmark"):
            _install.install(torch, config)
    assert [c[0] for c in fake_cuda] == ["pluggable", "change_current_allocator"]
    assert _install.STATE.cuda_allocator == "torch.cuda.memory.CUDAPluggableAllocator"
    assert tidepool.TidepoolFallbackWarning is _install.TidepoolFallbackWarning


def test_the_fallback_is_silent_with_log_off(fake_cuda):
    with warnings.catch_warnings():
        warnings.simplefilter("error", _install.TidepoolFallbackWarning)
        config = _config.claim("backend:tidepool,tidepool.log:off").config
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.cuda, "is_available", lambda: True)
            _install.install(torch, config)
    assert _install.STATE.cuda_allocator == "torch.cuda.memory.CUDAPluggableAllocator"


@pytest.mark.skipif(not os.environ.get("TIDEPOOL_TORCH_CUDA_LIBRARY"),
                    reason="no libtidepool_torch_cuda.so in this build (CUDA builds only)")
def test_the_real_libtidepool_torch_cuda_becomes_c10s_allocator(run_python):
    # In a fresh interpreter (the swap is for the life of the process), with torch told a
    # device is there: c10's CUDA allocator is no longer the native one, and the Python
    # record_stream wrapper is not needed.
    result = run_python(
        """
        import torch
        torch.cuda.is_available = lambda: True
        from tidepool import _config, _install
        before = torch.cuda.memory.get_allocator_backend()
        original = torch.Tensor.record_stream
        _install.install(torch, _config.claim("backend:tidepool,tidepool.optimizer_hooks:off").config)
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
        print("RESET", after["allocation.all.allocated"] == 0 and after["allocation.all.freed"] == 1)
        torch.cuda.reset_peak_memory_stats(0)
        print("PEAK_RESET", torch.cuda.max_memory_allocated(0) == torch.cuda.memory_allocated(0))
        print("PATCHED", torch.cuda.memory.memory_stats_as_nested_dict.__module__)
        # The fallback's ctypes mirror reads the same struct c10 is filled from.
        from tidepool import _torch_memory
        print("SAME_AS_FALLBACK", torch.cuda.memory.memory_stats_as_nested_dict(0) == _torch_memory.nested_stats(0))
        # The memory visualizer's snapshot comes from tidepool's backed ranges through c10.
        import os, pickle, tempfile
        held = lib.tidepool_malloc(3 << 20, 0, None)
        snap = torch.cuda.memory._snapshot()
        blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
        print("SNAPSHOT", any(b["address"] == held and b["state"] == "active_allocated"
                              and b["requested_size"] == 3 << 20 for b in blocks),
              sum(seg["total_size"] for seg in snap["segments"]) == _stats.raw_stats(0).reserved.current,
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


def test_pool_mode_keeps_pytorchs_allocator_and_makes_the_pool_on_first_use(fake_cuda):
    install(mode="pool")
    assert [c[0] for c in fake_cuda] == ["pluggable"]
    pool = _install.pool()
    assert _install.pool() is pool
    assert fake_cuda[1] == ("mempool", _install.STATE.allocator.handle)
    assert len(fake_cuda) == 2


def test_region_tags_and_in_pool_mode_routes_to_the_pool(fake_cuda):
    install(mode="pool")
    outside = _tags.current()
    with tidepool.region("activations_of_block_3") as tag:
        assert _tags.current() == tag
        assert _tags.tag_name(tag) == "activations_of_block_3"
        assert fake_cuda[-1] == ("enter_pool", None)
    assert _tags.current() == outside
    assert fake_cuda[-1] == ("exit_pool", None)


def test_host_backend_cannot_back_cuda_tensors(fake_cuda):
    with pytest.warns(_install.TidepoolInactiveWarning, match="device_backend:host"):
        install(device_backend="host")
    assert fake_cuda == []
    assert tidepool.status().startswith("inactive: tidepool.device_backend:host")


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


def test_global_mode_answers_torch_cuda_memory_functions_and_pool_mode_leaves_them(fake_cuda):
    originals = {name: getattr(torch.cuda.memory, name) for name in MEMORY_FUNCTIONS}
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
    _install.STATE.torch_memory.remove()
    assert all(getattr(torch.cuda.memory, n) is f and getattr(torch.cuda, n) is f
               for n, f in originals.items())


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


class RecordingSGD(torch.optim.SGD):
    """SGD that notes the allocation tag in force while its step runs."""

    seen_tags: list

    def step(self, closure=None):
        type(self).seen_tags.append(_tags.current())
        return super().step(closure)


@pytest.fixture
def fake_tiering(monkeypatch):
    moves = []
    monkeypatch.setattr(_tiering, "available", lambda: True)
    monkeypatch.setattr(_tiering, "prefetch_tag",
                        lambda d, tag, stream: moves.append(("prefetch", d, tag, stream)))
    monkeypatch.setattr(_tiering, "evict_tag",
                        lambda d, tag, stream: moves.append(("evict", d, tag, stream)))
    monkeypatch.setattr(_optim_hooks, "_cuda_devices", lambda optimizer: [0])
    monkeypatch.setattr(_optim_hooks, "_stream", lambda torch, d: 4242)
    return moves


@pytest.mark.parametrize("mode", ["global", "pool"])
def test_each_step_runs_tagged_between_prefetch_and_evict(fake_cuda, fake_tiering, mode):
    install(mode=mode, state_budget="1GiB")
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = RecordingSGD([p], lr=0.5, momentum=0.9)
    RecordingSGD.seen_tags = []
    outside = _tags.current()
    for _ in range(2):
        p.grad = torch.ones(4)
        optimizer.step()
    # The first step creates the momentum buffers; the second only has temporaries.
    assert RecordingSGD.seen_tags == [_tags.OPTIMIZER_STATE, _tags.WORKSPACE]
    assert _tags.current() == outside
    assert fake_tiering == [("prefetch", 0, _tags.OPTIMIZER_STATE, 4242),
                            ("evict", 0, _tags.OPTIMIZER_STATE, 4242)] * 2
    pool_events = [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")]
    assert pool_events == ([("enter_pool", 0), ("exit_pool", 0)] * 2 if mode == "pool" else [])
    # The update itself is SGD's, untouched: two momentum steps of 0.5 * (1, 1.9).
    assert torch.allclose(p.detach(), torch.full((4,), 1 - 0.5 - 0.95))


def test_parameters_added_later_get_their_state_tagged(fake_cuda, fake_tiering):
    install()
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    optimizer = RecordingSGD([a], lr=0.1, momentum=0.9)
    RecordingSGD.seen_tags = []
    a.grad = torch.ones(2)
    optimizer.step()
    optimizer.step()
    optimizer.add_param_group({"params": [b]})
    b.grad = torch.ones(3)
    optimizer.step()
    assert RecordingSGD.seen_tags == [_tags.OPTIMIZER_STATE, _tags.WORKSPACE, _tags.OPTIMIZER_STATE]


def test_a_library_without_the_pytorch_entry_points_is_a_clear_error(fake_cuda, monkeypatch):
    real_optional = _lib.optional
    monkeypatch.setattr(_lib, "optional",
                        lambda name: None if name == "tidepool_pytorch_malloc" else real_optional(name))
    with pytest.raises(_lib.LibraryError, match="tidepool_pytorch_malloc is missing"):
        install()
    assert fake_cuda == []


def test_with_no_state_budget_nothing_is_prefetched(fake_cuda, fake_tiering):
    # Note [state budget 0] in _optim_hooks.py: the state stays on the host.
    install()
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([p])
    for _ in range(2):
        p.grad = torch.ones(4)
        optimizer.step()
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)] * 2


def raising_closure():
    raise RuntimeError("boom")


@pytest.mark.parametrize("mode", ["global", "pool"])
def test_a_step_that_raises_closes_its_scope_and_evicts(fake_cuda, fake_tiering, mode):
    # Note [a step that raises]: torch runs no post-hook then; the guard does its work.
    install(mode=mode, state_budget="1GiB")

    class FreshAdamW(torch.optim.AdamW):  # a step() torch wraps only now, with the guard
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    optimizer = FreshAdamW([p])
    assert FreshAdamW.step.tidepool_guarded
    outside = _tags.current()
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step(raising_closure)
    assert _tags.current() == outside
    assert fake_tiering == [("prefetch", 0, _tags.OPTIMIZER_STATE, 4242),
                            ("evict", 0, _tags.OPTIMIZER_STATE, 4242)]
    pool_events = [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")]
    assert pool_events == ([("enter_pool", 0), ("exit_pool", 0)] if mode == "pool" else [])
    optimizer.step()  # and the optimizer carries on as usual
    assert _tags.current() == outside
    assert len(fake_tiering) == 4


def test_an_evict_that_fails_after_a_raising_step_does_not_hide_the_steps_error(
        fake_cuda, fake_tiering, monkeypatch):
    install()

    class FreshSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    def failing_evict(device, tag, stream):
        raise RuntimeError("tidepool: the copy engine is gone")

    monkeypatch.setattr(_tiering, "evict_tag", failing_evict)
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = FreshSGD([p], lr=0.1)
    outside = _tags.current()
    with pytest.warns(_install.TidepoolInactiveWarning, match="the copy engine is gone"), \
            pytest.raises(RuntimeError, match="boom"):
        optimizer.step(raising_closure)
    assert _tags.current() == outside


def test_a_step_wrapped_before_the_install_has_its_scope_closed_by_the_next_step(
        fake_cuda, fake_tiering):
    class EarlySGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    optimizer = EarlySGD([p], lr=0.1)  # torch wraps EarlySGD.step now, without tidepool
    install()
    outside = _tags.current()
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step(raising_closure)
    assert _tags.current() == _tags.OPTIMIZER_STATE  # no guard, and torch ran no post-hook
    optimizer.step()  # the next pre-hook closes the scope no running step owns
    assert _tags.current() == outside


@pytest.mark.parametrize("mode,budget", [("global", "0"), ("pool", "1GiB")])
def test_a_step_inside_a_step_keeps_the_outer_scope(fake_cuda, fake_tiering, mode, budget):
    install(mode=mode, state_budget=budget)

    class Inner(torch.optim.SGD):
        seen: list = []

        def step(self, closure=None):
            Inner.seen.append(_tags.current())
            return super().step(closure)

    class Lookahead(torch.optim.SGD):  # a wrapper whose step runs another optimizer's
        seen: list = []

        def __init__(self, params, inner):
            super().__init__(params, lr=0.0)
            self.inner = inner

        def step(self, closure=None):
            Lookahead.seen.append(_tags.current())
            self.inner.step()
            Lookahead.seen.append(_tags.current())
            return super().step(closure)

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    outer = Lookahead([a], Inner([b], lr=0.1, momentum=0.9))
    outside = _tags.current()
    outer.step()
    assert Inner.seen == [_tags.OPTIMIZER_STATE]
    assert Lookahead.seen == [_tags.OPTIMIZER_STATE, _tags.OPTIMIZER_STATE]
    assert _tags.current() == outside
    # The state moves once, around the outermost step; one pool scope per device.
    moves = [("evict", 0, _tags.OPTIMIZER_STATE, 4242)]
    if budget != "0":
        moves.insert(0, ("prefetch", 0, _tags.OPTIMIZER_STATE, 4242))
    assert fake_tiering == moves
    pool_events = [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")]
    assert pool_events == ([("enter_pool", 0), ("exit_pool", 0)] if mode == "pool" else [])
    fake_tiering.clear()
    with pytest.raises(RuntimeError, match="boom"):
        outer.inner.step(raising_closure)  # an inner step that raises on its own
    assert _tags.current() == outside
    assert fake_tiering == moves


def test_a_guarded_step_inside_an_unguarded_one_keeps_its_scope(fake_cuda, fake_tiering):
    class EarlyWrapper(torch.optim.SGD):  # torch wraps its step before the install
        seen: list = []

        def __init__(self, params, inner=None):
            super().__init__(params, lr=0.0)
            self.inner = inner

        def step(self, closure=None):
            self.inner.step()
            EarlyWrapper.seen.append(_tags.current())
            return super().step(closure)

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    EarlyWrapper([torch.nn.Parameter(torch.ones(1))])
    install()

    class LateInner(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    a.grad, b.grad = torch.ones(2), torch.ones(3)
    outer = EarlyWrapper([a], LateInner([b], lr=0.1))
    assert not getattr(EarlyWrapper.step, "tidepool_guarded", False)
    outside = _tags.current()
    outer.step()
    assert EarlyWrapper.seen == [_tags.OPTIMIZER_STATE]
    assert _tags.current() == outside


@pytest.mark.parametrize("where", ["pre", "post"])
def test_a_hook_that_raises_closes_the_scope_too(fake_cuda, fake_tiering, where):
    # torch runs tidepool's pre-hook before an optimizer's own and its post-hook after:
    # an own hook that raises skips tidepool's post-hook as a raising step() does.
    install(mode="pool")

    class FreshSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    def failing_hook(optimizer, args, kwargs):
        raise ValueError("gradient check failed")

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    optimizer = FreshSGD([p], lr=0.1)
    register = optimizer.register_step_pre_hook if where == "pre" else optimizer.register_step_post_hook
    register(failing_hook)
    outside = _tags.current()
    with pytest.raises(ValueError, match="gradient check failed"):
        optimizer.step()
    assert _tags.current() == outside
    assert [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")] == [
        ("enter_pool", 0), ("exit_pool", 0)]
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)]


@pytest.fixture
def untiered_state(monkeypatch, fake_tiering):
    """CPU tensors stand in for CUDA state; a state tensor counts as tiered once it was
    made by _adopt_tensor (what, on a GPU, lands in a pointer-stable range). Returns the
    tags in force at each adoption."""
    tiered: set[int] = set()
    adopted_under: list[int] = []

    def adopt(value):
        adopted_under.append(_tags.current())
        copy = value.clone()
        tiered.add(copy.data_ptr())
        return copy

    monkeypatch.setattr(_optim_hooks, "_on_cuda", lambda value: True)
    monkeypatch.setattr(_optim_hooks, "_adopt_tensor", adopt)
    monkeypatch.setattr(_tiering, "owns", lambda device, ptr: ptr in tiered)
    return adopted_under


@pytest.mark.parametrize("mode", ["global", "pool"])
def test_loaded_state_is_taken_into_tiering_and_evicted(fake_cuda, fake_tiering, untiered_state,
                                                        mode):
    # Note [loaded state]: resuming from a checkpoint must not leave the state resident.
    install(mode=mode, tier_min_bytes="64")
    torch.manual_seed(0)
    grads = [torch.randn(8, 4) for _ in range(4)]

    def model():
        return torch.nn.Parameter(torch.linspace(-1, 1, 32).reshape(8, 4))

    p = model()
    optimizer = torch.optim.AdamW([p], lr=1e-2)
    for g in grads[:2]:
        p.grad = g.clone()
        optimizer.step()
    # What torch.save / torch.load would give: copies, not the live state.
    checkpoint = {"param": p.detach().clone(), "optimizer": copy.deepcopy(optimizer.state_dict())}
    for g in grads[2:]:
        p.grad = g.clone()
        optimizer.step()
    uninterrupted = p.detach().clone()

    resumed = model()
    with torch.no_grad():
        resumed.copy_(checkpoint["param"])
    optimizer = torch.optim.AdamW([resumed], lr=1e-2)
    fake_tiering.clear()
    outside = _tags.current()
    optimizer.load_state_dict(checkpoint["optimizer"])
    state = optimizer.state[resumed]
    # exp_avg and exp_avg_sq (128 bytes each) are taken in under optimizer_state; the
    # 4-byte step counter stays below tier_min_bytes.
    assert untiered_state == [_tags.OPTIMIZER_STATE] * 2
    assert all(_tiering.owns(0, state[k].data_ptr()) for k in ("exp_avg", "exp_avg_sq"))
    assert not _tiering.owns(0, state["step"].data_ptr())
    assert torch.equal(state["exp_avg"], checkpoint["optimizer"]["state"][0]["exp_avg"])
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)]
    assert _tags.current() == outside
    pool_events = [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")]
    assert pool_events[-2:] == ([("enter_pool", 0), ("exit_pool", 0)] if mode == "pool" else [])
    for g in grads[2:]:
        resumed.grad = g.clone()
        optimizer.step()
    assert torch.equal(resumed.detach(), uninterrupted), "resuming changes no bit"
    # A tensor subclass without the flatten protocol is not one storage to copy: left as
    # it is (DTensor has the protocol: test_loaded_dtensor_state_...).
    assert not _optim_hooks._outside_tiering(torch.nn.Parameter(torch.ones(64)), 0)
    # Loading state that is already tiered (the same tensors) takes nothing in, moves nothing.
    fake_tiering.clear()
    optimizer.load_state_dict(optimizer.state_dict())
    assert len(untiered_state) == 2
    assert fake_tiering == []


@pytest.fixture
def fake_process_group():
    """A two-rank process group whose collectives do nothing (PyTorch's own "fake"
    backend), enough for DTensor on the CPU in one process."""
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    from torch.distributed.tensor import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,))
    dist.destroy_process_group()


def test_loaded_dtensor_state_is_taken_in_through_its_local_shard(
        fake_cuda, fake_tiering, untiered_state, fake_process_group):
    # FSDP2 keeps each rank's optimizer state as DTensors over its shard: the local shard
    # is the memory to tier, the DTensor around it keeps its mesh and placements.
    from torch.distributed.tensor import DTensor, Shard
    install(tier_min_bytes="64")
    mesh = fake_process_group

    def sharded(local):
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    torch.manual_seed(0)
    grads = [torch.randn(32) for _ in range(4)]
    p = torch.nn.Parameter(sharded(torch.linspace(-1, 1, 32)))
    optimizer = torch.optim.AdamW([p], lr=1e-2)
    for g in grads[:2]:
        p.grad = sharded(g.clone())
        optimizer.step()
    checkpoint = {"param": p.to_local().detach().clone(),
                  "optimizer": copy.deepcopy(optimizer.state_dict())}
    for g in grads[2:]:
        p.grad = sharded(g.clone())
        optimizer.step()
    uninterrupted = p.to_local().detach().clone()

    resumed = torch.nn.Parameter(sharded(checkpoint["param"].clone()))
    optimizer = torch.optim.AdamW([resumed], lr=1e-2)
    untiered_state.clear()
    fake_tiering.clear()
    optimizer.load_state_dict(checkpoint["optimizer"])
    state = optimizer.state[resumed]
    assert untiered_state == [_tags.OPTIMIZER_STATE] * 2  # exp_avg's and exp_avg_sq's shards
    for key in ("exp_avg", "exp_avg_sq"):
        assert type(state[key]) is DTensor
        assert state[key].placements == (Shard(0),) and state[key].device_mesh == mesh
        assert state[key]._spec == checkpoint["optimizer"]["state"][0][key]._spec
        assert state[key].grad_fn is None
        assert _tiering.owns(0, state[key].to_local().data_ptr())
        assert torch.equal(state[key].to_local(),
                           checkpoint["optimizer"]["state"][0][key].to_local())
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)]
    for g in grads[2:]:
        resumed.grad = sharded(g.clone())
        optimizer.step()
    assert torch.equal(resumed.to_local().detach(), uninterrupted), "resuming changes no bit"


def test_load_state_dict_is_put_back_on_removal(fake_cuda, fake_tiering):
    original = torch.optim.Optimizer.load_state_dict
    install()
    assert torch.optim.Optimizer.load_state_dict is not original
    assert torch.optim.Optimizer.load_state_dict.__wrapped__ is original
    for handle in _install.STATE.optimizer_hooks:
        handle.remove()
    _install.STATE.optimizer_hooks = None
    assert torch.optim.Optimizer.load_state_dict is original


def test_torchs_step_patcher_is_put_back_as_the_staticmethod_it_was(fake_cuda, fake_tiering):
    original = vars(torch.optim.Optimizer)["profile_hook_step"]
    install()
    assert vars(torch.optim.Optimizer)["profile_hook_step"] is not original
    for handle in _install.STATE.optimizer_hooks:
        handle.remove()
    _install.STATE.optimizer_hooks = None
    assert vars(torch.optim.Optimizer)["profile_hook_step"] is original

    class LaterSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    LaterSGD([p], lr=0.5).step()
    assert torch.equal(p.detach(), torch.full((2,), 0.5))
    assert not getattr(LaterSGD.step, "tidepool_guarded", False)


def test_stock_adamw_foreach_and_plain_give_identical_results_with_the_hooks(fake_cuda, fake_tiering):
    torch.manual_seed(0)
    grads = [torch.randn(5, 3) for _ in range(3)]

    def train(foreach):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 15).reshape(5, 3))
        optimizer = torch.optim.AdamW([p], lr=1e-2, foreach=foreach)
        for g in grads:
            p.grad = g.clone()
            optimizer.step()
        return p.detach().clone()

    reference = train(False)
    install()
    assert torch.equal(train(False), reference)
    assert torch.allclose(train(True), reference, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, imported by dynamo
def test_a_compiled_training_step_still_moves_the_state(fake_cuda, fake_tiering):
    # torch.compile traces through torch's hooked step: the hooks and the guard (ctypes
    # calls, thread-local scopes) must still run around every step, in order.
    install()

    class FreshAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(4))
    optimizer = FreshAdamW([p], lr=0.1)
    outside = _tags.current()

    @torch.compile(backend="eager")
    def train_step():
        p.grad = torch.ones(4)
        optimizer.step()

    for _ in range(3):
        train_step()
    assert _tags.current() == outside
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)] * 3
