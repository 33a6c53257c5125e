"""torch's CUDA entry points replaced by recorders, for the tests of what installation
does inside torch on a machine without a GPU (test_install_flow.py, test_optim_hooks.py):
`fake_cuda` records which allocator is registered and when a MemPool is made or entered
(and, as PyTorch does, refuses to enter a MemPool on a device where it is entered
already, by any thread; and refuses one made on another device, which PyTorch would
serve without tidepool); `install(**keys)` runs the package's install with torch.cuda
claiming a device."""

from __future__ import annotations

import contextlib
import threading
import warnings

import pytest
import torch

from tidepool import _config, _install, _lib


REAL_DEVICE_COUNT = torch.cuda.device_count


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = []

    class FakePluggableAllocator:
        def __init__(self, path, alloc_fn, free_fn):
            calls.append(("pluggable", path, alloc_fn, free_fn))
            self.handle = object()

        def allocator(self):
            return self.handle

    current = threading.local()  # the thread's current device, as torch.cuda keeps it

    def current_device():
        return getattr(current, "device", 0)

    @contextlib.contextmanager
    def fake_device(device):
        before = current_device()
        current.device = device
        try:
            yield
        finally:
            current.device = before

    class FakeMemPool:
        def __init__(self, allocator):
            # at::cuda::MemPool: the allocator serves the device current now, only there.
            self.device = current_device()
            calls.append(("mempool", allocator))

    recording = set()  # (pool, device): entered, by whichever thread
    lock = threading.Lock()

    @contextlib.contextmanager
    def fake_use_mem_pool(pool, device=None):
        # c10's beginAllocateToPool: one recording of a pool per device at a time.
        key = (id(pool), current_device() if device is None else device)
        if pool.device != key[1]:
            # PyTorch would route to a pool of that device without tidepool's allocator.
            raise RuntimeError(f"fake: a MemPool made on device {pool.device} entered on "
                               f"device {key[1]}, where tidepool does not serve it")
        with lock:
            if key in recording:
                raise RuntimeError("beginAllocateToPool: already recording to mempool_id")
            recording.add(key)
            calls.append(("enter_pool", device))
        try:
            yield
        finally:
            with lock:
                recording.discard(key)
                calls.append(("exit_pool", device))

    monkeypatch.setattr(torch.cuda.memory, "CUDAPluggableAllocator", FakePluggableAllocator)
    monkeypatch.setattr(torch.cuda.memory, "change_current_allocator",
                        lambda allocator: calls.append(("change_current_allocator", allocator)))
    monkeypatch.setattr(torch.cuda, "MemPool", FakeMemPool)
    monkeypatch.setattr(torch.cuda, "use_mem_pool", fake_use_mem_pool)
    monkeypatch.setattr(torch.cuda, "current_device", current_device)
    # The fake machine's four devices, as tidepool asks torch (_install.device_count);
    # REAL_DEVICE_COUNT for a test of torch's own answer.
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "device", fake_device)
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
        patch.setattr(torch.cuda, "device_count", lambda: 4)
        _install.install(torch, _config.claim(conf).config)
