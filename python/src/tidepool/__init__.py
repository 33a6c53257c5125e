"""tidepool: a CUDA caching allocator with optimizer-state tiering for PyTorch.

Turn it on without changing code:

    PYTORCH_CUDA_ALLOC_CONF=backend:tidepool python train.py

(see python/README.md for the tidepool.* keys). The API below is for those who want
more: tagged regions, statistics, snapshots, explicit evict/prefetch (of a tag, an
optimizer's state or tensors). tidepool.optim has tidepool's Apollo and AADL.

This module is imported by the start-up hook in every Python process, so it imports
nothing heavy at module level (no ctypes, no torch): everything loads on first use.
"""

from __future__ import annotations

import _thread
import contextlib
import sys

__all__ = ["region", "stats", "snapshot", "evict", "prefetch", "enable_peer_access", "status",
           "config", "install", "ConfigError", "LibraryError", "TidepoolInactiveWarning",
           "TidepoolFallbackWarning"]
__version__ = "0.1.0"


def __getattr__(name):  # PEP 562: the exception classes and tidepool.optim load on first use
    if name == "ConfigError":
        from ._config import ConfigError
        return ConfigError
    if name == "LibraryError":
        from ._lib import LibraryError
        return LibraryError
    if name in ("TidepoolInactiveWarning", "TidepoolFallbackWarning"):
        from . import _install
        return getattr(_install, name)
    if name == "optim":  # Apollo and AADL (optim.py); imports torch, so only when asked
        import importlib
        return importlib.import_module(".optim", __name__)
    raise AttributeError(f"module 'tidepool' has no attribute {name!r}")


def status() -> str:
    """'active: mode global', 'inactive: <reason>', 'failed: <reason>' (the configuration
    or the installation failed; the error was raised where it happened) or
    'not enabled: ...'."""
    from ._install import STATE
    return STATE.status


def config() -> dict:
    """The configuration libtidepool applied (allocator/config.h), as a dict."""
    from ._config import active_config
    return active_config()


# tidepool.install(): one call at a time. _thread, not threading: the start-up hook
# imports this package in every Python process, and must cost next to nothing.
_INSTALL_LOCK = _thread.RLock()


def install(conf: str | None = None) -> str:
    """Installs tidepool now, for programs that cannot use the start-up hook.

    With `conf` (tidepool keys only, e.g. "backend:tidepool,tidepool.mode:pool") that
    configuration is applied, and kept in TIDEPOOL_ALLOC_CONF for child processes (as
    the hook does); without, the environment is claimed as the hook does (under the
    LD_PRELOAD shim, which claimed it and serves tidepool, nothing more). torch must not
    have used CUDA yet. Once tidepool is installed its configuration stays: calling again
    with the same keys changes nothing, with others is a ConfigError. Returns status().
    One call at a time (review finding: two threads with two configurations both got
    through, one mode installed in Python and the other's budgets in libtidepool).
    """
    with _INSTALL_LOCK:
        return _install_now(conf)


def _install_now(conf: str | None) -> str:
    import os

    from . import _config, _install, _startup
    if _startup.error_pending():
        # The hook's error from start-up stays in its import finder, which raises it at
        # `import torch` below; the environment may have been fixed since: read it again
        # (a ConfigError still there is raised at the import, as the hook raises it).
        _startup.start()
    import torch

    if conf is None:
        if _install.STATE.torch is not None:
            return status()
        _startup.start()  # installs at once: torch is imported
        if _startup.preload_shim_in_charge():
            return status()  # the shim serves tidepool; start() stood aside, as the hook does
        if _install.STATE.torch is None:
            raise _config.ConfigError(
                "tidepool.install(): neither PYTORCH_ALLOC_CONF nor PYTORCH_CUDA_ALLOC_CONF "
                "names tidepool; set one or pass the keys as conf")
        return status()
    claimed = _config.claim(conf)
    if not claimed.enabled:
        raise _config.ConfigError(f"tidepool.install(): {conf!r} names no tidepool key")
    if claimed.remaining:
        # PyTorch read its own keys from the environment already (torch is imported).
        raise _config.ConfigError(
            f"tidepool.install(): {claimed.remaining!r} in {conf!r} are PyTorch's keys, which "
            "it reads from PYTORCH_CUDA_ALLOC_CONF itself; pass only tidepool's keys here")
    if _install.STATE.torch is None and _startup.preload_shim_in_charge():
        # The shim serves tidepool (a second allocator installed here on top of it would
        # serve PyTorch instead): with the configuration it claimed, or, while it waits
        # for the first cudaMalloc, with conf from now on.
        if not _startup.preload_shim_waiting():
            if claimed.config != _config.active_config():
                raise _config.ConfigError(
                    f"tidepool.install(): the LD_PRELOAD shim serves tidepool with the "
                    f"configuration it claimed at start-up; {conf!r} cannot change it")
            return status()
        if _startup.set_up_preload_shim_with(conf, claimed.config):
            _install.STATE.status = (
                "active: through the LD_PRELOAD shim (libtidepool_preload.so)")
            return status()
        # The shim turned itself off (it said why): the hook installs tidepool instead.
    other = _other_backend_in_environment()
    if other is not None and not (claimed.config["mode"] == "pool" and other[1] == "native"):
        # The check the hook makes (Note [one backend] in allocator/config.cpp), which the
        # child processes, given conf in TIDEPOOL_ALLOC_CONF, would make and fail.
        raise _config.ConfigError(
            f"tidepool.install(): {conf!r} turns tidepool on, which conflicts with "
            f"'backend:{other[1]}' in {other[0]}; name one backend")
    expandable = _expandable_segments_in_environment()
    if expandable is not None and claimed.config["mode"] == "pool":
        # Note [expandable segments] in allocator/config.cpp, as the hook checks it.
        raise _config.ConfigError(
            f"tidepool.install(): {conf!r} turns tidepool on, which conflicts with "
            f"'expandable_segments:True' in {expandable}: pool mode puts optimizer state in a "
            "torch.cuda.MemPool, and PyTorch does not support MemPools with expandable "
            "segments; drop expandable_segments:True or use tidepool.mode:global")
    if _install.STATE.torch is not None:
        if claimed.config != _install.STATE.config:
            raise _config.ConfigError(
                f"tidepool.install(): tidepool is installed already ({status()}) with another "
                f"configuration; {conf!r} cannot change it in a running process")
        return status()
    applied = _config.apply(conf)
    _install.install(torch, applied)
    # What child processes apply (the hook's way); only once installed here: a failed
    # install must not make the children use tidepool.
    os.environ["TIDEPOOL_ALLOC_CONF"] = conf
    return status()


def _pytorch_entries():
    """(variable, key, value), stripped, of every entry of the variable PyTorch reads its
    allocator's keys from (Note [the variable PyTorch reads] in allocator/config.cpp)."""
    import os

    from . import _config
    variable = _config.variable_pytorch_reads()
    for entry in os.environ.get(variable, "").split(","):
        key, _, value = entry.partition(":")
        yield variable, key.strip(), value.strip()


def _other_backend_in_environment() -> tuple[str, str] | None:
    """(variable, X) for the first backend:X other than tidepool in the variable PyTorch
    reads; None without one."""
    return next(((variable, value) for variable, key, value in _pytorch_entries()
                 if key == "backend" and value not in ("", "tidepool")), None)


def _expandable_segments_in_environment() -> str | None:
    """The variable PyTorch reads when it turns PyTorch's expandable_segments on; None if
    it does not."""
    return next((variable for variable, key, value in _pytorch_entries()
                 if key == "expandable_segments" and value.lower() == "true"), None)


def _device(device) -> int:
    """The CUDA device index of `device` (an int, "cuda:1", torch.device; None or a
    device without an index: the current device)."""
    if isinstance(device, int):
        # ctypes passes a C int on modulo 2**32: 2**32 would read device 0.
        if isinstance(device, bool) or not -2**31 <= device < 2**31:
            raise ValueError(f"tidepool: {device!r} is not a CUDA device index")
        return device
    if device is not None:
        import torch
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"tidepool: {device} is not a CUDA device")
        if device.index is not None:
            return device.index
    torch = _torch_using_cuda()
    return torch.cuda.current_device() if torch is not None else 0


def _stream(device: int, stream):
    """The CUDA stream handle of `stream` (a torch.cuda.Stream or a handle; None: the
    current stream). Anything else is refused here: ctypes would hand CUDA a str or a
    float as a stream handle."""
    if stream is not None:
        handle = getattr(stream, "cuda_stream", stream)
        if not isinstance(handle, int) or isinstance(handle, bool):
            raise TypeError("tidepool: stream must be a torch.cuda.Stream, a stream handle "
                            f"(int) or None, not {stream!r}")
        return handle
    torch = _torch_using_cuda()
    return torch.cuda.current_stream(device).cuda_stream if torch is not None else None


def _torch_using_cuda():
    """torch, when its current device and stream are what tidepool serves: tidepool is
    installed in it, or torch has initialised CUDA (under the LD_PRELOAD shim, where
    nothing is installed in Python, torchrun's rank 1 works on device 1 all the same).
    None otherwise: asking torch before CUDA is initialised would initialise it."""
    from ._install import STATE
    if STATE.active:
        return STATE.torch
    torch = sys.modules.get("torch")
    return torch if torch is not None and torch.cuda.is_initialized() else None


def _region_devices(device) -> list:
    """region()'s `device` as the list use_mem_pool is entered for, each device once, in
    the order given; None stands for the current device (device None, or
    torch.device("cuda") without an index)."""
    if device is None:
        return [None]
    items = list(device) if isinstance(device, (list, tuple, set, frozenset, range)) else [device]
    devices = []
    for item in items:
        if isinstance(item, str):  # "cuda:1", "cuda": what torch takes (python/README.md)
            import torch
            try:
                item = torch.device(item)
            except RuntimeError:
                raise ValueError(f"tidepool.region: device {item!r} is not a device torch "
                                 "knows") from None
        if getattr(item, "type", "cuda") != "cuda":
            index = -1
        else:
            index = getattr(item, "index", item)  # a torch.device("cuda", i) or an int
        if index is None and item is not None:
            pass  # torch.device("cuda"): the current device
        elif isinstance(index, bool) or not isinstance(index, int) or index < 0:
            raise ValueError(f"tidepool.region: device must be a CUDA device index (an int >= 0), "
                             f"a torch.device('cuda', i), 'cuda:i', or a list of them; got "
                             f"{item!r}")
        if index not in devices:
            devices.append(index)
    if not devices:
        raise ValueError("tidepool.region: device is an empty list; name at least one device, "
                         "or leave it out for the current one")
    # Checked here, not left to use_mem_pool: in global mode nothing else would look at
    # the index, and a region on a device that does not exist did nothing, silently.
    from . import _install
    count = _install.device_count()
    for index in devices:
        if count is not None and index is not None and index >= count:
            raise ValueError(f"tidepool.region: device {index} does not exist: this process "
                             f"sees {count} CUDA device{'s' if count != 1 else ''} "
                             f"(0..{count - 1})")
    return devices


@contextlib.contextmanager
def region(tag: str | int = "user", device=None):
    """Allocations made by this thread inside the block carry `tag` (for stats and for
    evict/prefetch). In pool mode they are also served from a tidepool MemPool of the
    tag's own (Note [a MemPool per tag] in _install.py), one that no other thread uses on
    the device meanwhile (Note [one MemPool per thread and device at a time]): on the
    current device, or on each device `device` names
    (an index, a torch.device, "cuda:i", or a list of them, for a process that allocates on several
    GPUs inside the block). In global mode every device's allocations are tidepool's
    anyway, and `device` only has to exist (a ValueError otherwise, in either mode)."""
    from . import _install, _tags
    tag_id = _tags.tag_id(tag)
    devices = _region_devices(device)
    with contextlib.ExitStack() as stack:
        if _install.pool_mode():
            for d in devices:
                stack.enter_context(_install.pool_lease(d, tag_id))
        _tags.push(tag_id)
        try:
            yield tag_id
        finally:
            _tags.pop()


def stats(device=None) -> dict:
    """Allocator statistics, keyed like torch.cuda.memory_stats() ("allocated_bytes.all.
    current", "reserved_bytes.all.peak", ...), plus "tag.<name>.current|peak|allocated|
    freed|count|total_count" and the tag's cached memory "tag.<name>.cached_bytes|
    largest_free_block|fragmentation" for every tag used, and transfer figures when
    tiering is built."""
    from ._stats import stats as read
    return read(_device(device))


def snapshot(device=None) -> dict:
    """Segments, blocks and stats of the allocator, parsed from its JSON snapshot."""
    from ._stats import snapshot as read
    return read(_device(device))


def evict(tag="optimizer_state", device=None, stream=None) -> None:
    """Moves to host memory, at the same addresses and ordered after `stream`'s work,
    every allocation under `tag` (a name or an id) on `device`; or, given an optimizer or
    tensors instead of a tag, only what holds them (below).

    `tag` may be a torch.optim.Optimizer: its state tensors on CUDA devices, those the
    optimizer hooks prefetch before its step (its state elsewhere, a CPU step counter, is
    left out); or a tensor or an iterable of tensors: their storages (a DTensor's local
    shard). Each of their pointer-stable ranges moves once; one that is in none (ordinary
    device memory: not optimizer state, under tidepool.tier_min_bytes, or not tidepool's)
    is skipped, as by the C ABI's calls by pointers, not an error. Then `device` (None:
    every device they are on) keeps an optimizer's state on that device only, and a
    tensor on another device is a ValueError, as is one not on a CUDA device or without
    a storage (a sparse tensor). `stream` (None: each device's current stream) must then
    serve one device. Anything else is a TypeError."""
    from . import _tiering
    if not isinstance(tag, (str, int)):
        for d, ptrs in _pointers(tag, device, stream).items():
            _tiering.evict_ptrs(d, ptrs, _stream(d, stream))
        return
    from . import _tags
    d = _device(device)
    tag_id, stream = _tags.existing_tag_id(tag), _stream(d, stream)
    if tag_id is not None:  # else nothing was ever allocated under it
        _tiering.evict_tag(d, tag_id, stream)


def prefetch(tag="optimizer_state", device=None, stream=None) -> int:
    """Brings the allocations under `tag` (a name or an id) back to `device`, usable on
    `stream`, oldest first, as far as tidepool.state_budget allows; or, given an
    optimizer or tensors, only what holds them, in their order (as evict() takes them).
    Returns the bytes that stayed in host memory (still usable at the same addresses,
    only slower)."""
    from . import _tiering
    if not isinstance(tag, (str, int)):
        return sum(_tiering.prefetch_ptrs(d, ptrs, _stream(d, stream))
                   for d, ptrs in _pointers(tag, device, stream).items())
    from . import _tags
    d = _device(device)
    tag_id, stream = _tags.existing_tag_id(tag), _stream(d, stream)
    if tag_id is None:  # nothing was ever allocated under it
        return 0
    return _tiering.prefetch_tag(d, tag_id, stream)


def _pointers(what, device, stream) -> dict:
    """device -> the pointers naming `what` (an optimizer or tensors) for evict / prefetch."""
    from ._by_pointer import pointers
    return pointers(what, None if device is None else _device(device), stream is not None)


def enable_peer_access(device, peer) -> None:
    """Lets CUDA device `peer` read and write the memory tidepool maps for `device`
    (expandable segments and optimizer state, now and mapped later), which
    cudaDeviceEnablePeerAccess alone does not: a kernel on `peer` reading it would fault.
    Global mode does this in PyTorch's enablePeerAccess by itself; pool mode and the
    LD_PRELOAD shim need this call before such kernels run. A device tidepool has not
    used yet gets no CUDA context for it. Devices are ints, "cuda:N" or torch.device.
    Raises RuntimeError for a device or peer that does not exist, peer == device, or a
    peer that cannot access the device (no P2P between them)."""
    from . import _lib
    d, p = _device(device), _device(peer)
    fn = _lib.function("tidepool_enable_peer_access", "peer access")
    _lib.check(fn(d, p), f"enable_peer_access({d}, {p})")
