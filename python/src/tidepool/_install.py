"""Installs tidepool into a freshly imported torch, and keeps what was installed.

Two modes (tidepool.mode, see allocator/config.h):
  global  every CUDA allocation of the process is tidepool's (no PyTorch caching on top;
          tidepool caches itself; optimizer state of at least tidepool.tier_min_bytes
          goes to pointer-stable ranges). c10's CUDA allocator becomes, preferably,
          libtidepool_torch_cuda.so's (optimizers/install/torch_cuda_allocator.h), whose
          cacheInfo (cuDNN's autotuner) and record_stream (also from PyTorch's C++) reach
          tidepool; without that library (a package built without torch, or against
          another torch) torch.cuda.memory.CUDAPluggableAllocator(libtidepool.so,
          tidepool_pytorch_malloc, tidepool_pytorch_free) + change_current_allocator,
          with torch.Tensor.record_stream wrapped to reach tidepool (_record_stream.py)
          and a warning that cudnn.benchmark cannot work. Either way torch.cuda's memory
          statistics, empty_cache and the memory fraction answer from tidepool: through
          c10 with the library, through torch.cuda's replaced functions without it
          (_torch_memory.py).
  pool    PyTorch keeps its own allocator; a torch.cuda.MemPool backed by tidepool
          serves tidepool.region() and optimizer steps. Inside a region PyTorch's
          caching allocator asks tidepool for whole segments.
Without a usable CUDA device tidepool stays inactive: a TidepoolInactiveWarning (unless
tidepool.log:off) and `import torch` carries on as usual.
"""

from __future__ import annotations

import os
import sys
import threading
import warnings

from . import _lib, _tags


class TidepoolInactiveWarning(RuntimeWarning):
    """tidepool was asked for but cannot act in this process (e.g. no CUDA device)."""


class _State:
    def __init__(self):
        self.lock = threading.Lock()
        self.status = "not enabled: PYTORCH_CUDA_ALLOC_CONF names no tidepool key"
        self.active = False
        self.config: dict | None = None
        self.torch = None
        self.allocator = None  # the CUDAPluggableAllocator (pool mode; global-mode fallback)
        self.cuda_allocator = None  # global mode: what c10's CUDA allocator is
        # Pool mode (Note [one MemPool per thread and device at a time]): (device, tag) ->
        # every MemPool made for allocations under that tag there (a MemPool serves with
        # tidepool only on the device that was current when it was made: Note [a MemPool
        # per device]; Note [a MemPool per tag]), and device -> {thread ident: its stack of
        # _Lease, innermost last}.
        self.pools: dict[tuple[int, int], list] = {}
        self.pool_leases: dict[int, dict[int, list]] = {}
        self.optimizer_hooks = None  # two step-hook handles and the load_state_dict Patches
        self.record_stream = None  # global mode: the handle of the record_stream wrapper
        self.torch_memory = None  # global-mode fallback: the torch.cuda memory functions' handle


STATE = _State()


def _inactive(reason: str, config: dict) -> None:
    STATE.status = f"inactive: {reason}"
    STATE.active = False
    if config.get("log") != "off":
        warnings.warn(f"tidepool: {reason}; tidepool is inactive and PyTorch uses its own "
                      "allocator", TidepoolInactiveWarning, stacklevel=3)


def warn_beside_error(message: str) -> None:
    """Says `message` (a TidepoolInactiveWarning) while another error is on its way out
    of a step. Where warnings are errors (`-W error`), the warning must not take that
    error's place (review finding: a loop that catches torch.cuda.OutOfMemoryError to
    retry got the warning instead): it is printed on stderr then."""
    try:
        warnings.warn(message, TidepoolInactiveWarning, stacklevel=3)
    except Warning:
        print(f"TidepoolInactiveWarning: {message}", file=sys.stderr)


def entry_points(mode: str = "global") -> tuple[str, str, str]:
    """(library, malloc, free) for CUDAPluggableAllocator. Both pairs route optimizer
    state to pointer-stable, evictable ranges. Global mode: libtidepool's PyTorch pair,
    which throws tidepool's message on failure (PyTorch's current allocator is not
    checked for NULL). Pool mode: the pair whose malloc returns NULL for out of memory
    (PyTorch's caching allocator then frees its own cache, retries and raises
    torch.OutOfMemoryError) and throws tidepool's message for any other failure.
    LibraryError when the build lacks them."""
    path = _lib.library_path()
    names = _lib.PYTORCH_ENTRY_POINTS if mode == "global" else _lib.POOL_ENTRY_POINTS
    for name in names:
        _lib.function(name, "the PyTorch allocator entry points")
    return (path, *names)


def install(torch, config: dict) -> None:
    """Installs tidepool as `config` (the active configuration's JSON) says."""
    with STATE.lock:
        if STATE.torch is not None:
            return  # installed already (e.g. tidepool.install() after the hook)
        STATE.torch = torch
        STATE.config = config
        # device_count asks NVML first; is_available (without PYTORCH_NVML_BASED_CUDA_CHECK)
        # calls cuInit, and a process that did cannot use CUDA in a forked child: at
        # `import torch` that would break every launcher that forks its GPU workers.
        if torch.cuda.device_count() == 0:
            _inactive("no CUDA device is available", config)
            return
        if config.get("device_backend") == "host":
            _inactive("tidepool.device_backend:host serves host memory, which cannot back "
                      "CUDA tensors", config)
            return
        # With device_backend auto, libtidepool takes the variable's word for it (the
        # README's TIDEPOOL_BACKEND): host memory handed to PyTorch as CUDA memory.
        if config.get("device_backend", "auto") == "auto" and \
                os.environ.get("TIDEPOOL_BACKEND") == "host":
            _inactive("TIDEPOOL_BACKEND=host serves host memory, which cannot back CUDA "
                      "tensors (unset it, or set it to cuda or auto)", config)
            return
        try:
            path, malloc_name, free_name = entry_points(config["mode"])
        except _lib.LibraryError as e:
            STATE.torch = STATE.config = None  # nothing installed; a fixed library may retry
            STATE.status = f"failed: {e}"
            raise
        # Warnings are given once everything is in place: with warnings turned into
        # errors, one raised halfway would leave an allocator installed without the rest.
        later_warnings = []
        try:
            if config["mode"] == "global":
                _install_global(torch, config, path, malloc_name, free_name, later_warnings)
            else:
                STATE.allocator = torch.cuda.memory.CUDAPluggableAllocator(path, malloc_name,
                                                                           free_name)
        except _lib.LibraryError as e:
            # A library that is not there (TIDEPOOL_TORCH_CUDA_LIBRARY naming no file): the
            # caller's `except tidepool.LibraryError` catches it, as at the entry points;
            # review finding: it became a RuntimeError blaming CUDA's first use.
            STATE.torch = STATE.config = None  # nothing installed
            STATE.status = f"failed: {e}"
            raise
        except RuntimeError as e:
            STATE.torch = STATE.config = None  # nothing installed
            STATE.status = f"failed: cannot install the allocator ({e})"
            raise RuntimeError(
                f"tidepool: cannot install the allocator from {path} ({e}). tidepool must be "
                "installed before CUDA is first used in this process") from e
        try:
            if config.get("optimizer_hooks", True):
                from . import _optim_hooks

                STATE.optimizer_hooks = _optim_hooks.register(torch)
        except BaseException as e:
            STATE.status = (f"failed: the allocator is installed (mode {config['mode']}) but the "
                            f"optimizer step hooks are not: {e}")
            raise
        STATE.active = True
        STATE.status = f"active: mode {config['mode']}"
        if config.get("log") in ("info", "debug"):
            import sys

            via = f", c10's CUDA allocator: {STATE.cuda_allocator}" if STATE.cuda_allocator else ""
            print(f"tidepool: installed ({STATE.status}, library {path}{via})", file=sys.stderr)
    for message, category in later_warnings:
        warnings.warn(message, category, stacklevel=3)


class TidepoolFallbackWarning(RuntimeWarning):
    """Global mode runs on torch's CUDAPluggableAllocator class: cuDNN autotuning and
    record_stream from PyTorch's C++ do not reach tidepool."""


def _install_global(torch, config: dict, path: str, malloc_name: str, free_name: str,
                    later_warnings: list) -> None:
    """Makes tidepool c10's CUDA allocator (see the top of this module); appends the
    warnings to give once the installation is complete to `later_warnings`."""
    shim, why_not = _lib.load_torch_cuda()
    if shim is not None:
        _lib.check(shim.tidepool_torch_install_cuda_allocator(),
                   "making tidepool PyTorch's CUDA allocator")
        STATE.cuda_allocator = _lib.torch_cuda_library_path()
    else:
        STATE.allocator = torch.cuda.memory.CUDAPluggableAllocator(path, malloc_name, free_name)
        torch.cuda.memory.change_current_allocator(STATE.allocator)
        from . import _record_stream

        STATE.record_stream = _record_stream.register(torch)
        STATE.cuda_allocator = "torch.cuda.memory.CUDAPluggableAllocator"
        if config.get("log") != "off":
            later_warnings.append((
                f"tidepool: {why_not}, so tidepool runs on torch's CUDAPluggableAllocator, "
                "which cannot answer cuDNN's autotuner: torch.backends.cudnn.benchmark = True "
                "fails in convolutions, record_stream calls from PyTorch's C++ are not seen, "
                "and CUDA graph capture is not refused although global mode has no memory "
                "pools for it. Install the package with "
                "`pip install --no-build-isolation ./python` against this torch to build "
                "libtidepool_torch_cuda.so.",
                TidepoolFallbackWarning))
        from . import _torch_memory

        STATE.torch_memory = _torch_memory.register(torch)


def device_count() -> int | None:
    """The CUDA devices of this process when tidepool is installed in torch, else None
    (unknown: asking torch could initialise CUDA). Asked of torch each time (NVML before
    CUDA starts, cached after): CUDA_VISIBLE_DEVICES may change after `import torch` until
    CUDA starts (a launcher setting it per rank), and the count taken at the install then
    let a device that no longer exists pass (review finding)."""
    return STATE.torch.cuda.device_count() if STATE.active else None


def pool_mode() -> bool:
    """Whether tidepool is installed in pool mode (route allocations with pool_lease)."""
    return STATE.active and STATE.config["mode"] == "pool"


def pool(device: int | None = None, tag: int | None = None):
    """The first tidepool MemPool of `device` (None: the current device) for allocations
    under `tag` (None: optimizer_state) in pool mode (created on first use), else None.
    Route allocations with pool_lease(), which may take another one."""
    if not STATE.active or STATE.config["mode"] != "pool":
        return None
    if device is None:
        device = STATE.torch.cuda.current_device()
    with STATE.lock:
        return _pool_locked(device, _tags.OPTIMIZER_STATE if tag is None else tag, 0)


def _pool_locked(device: int, tag: int, index: int):
    """STATE.pools[(device, tag)][index], made (with those before it) if it does not exist
    yet. Pre: STATE.lock held, pool mode.

    Note [a MemPool per tag]: PyTorch's caching allocator keeps a MemPool's freed blocks
    and hands them to the pool's next allocations, whatever tag tidepool had when it made
    their segment. With one pool for every scope, optimizer state made after a region's
    blocks were freed (with tidepool.region("kv_cache"): ...) could land in them: not in a
    pointer-stable range, so never evicted; and a region's tensors could land in freed
    state blocks, moved to the host after every step. So allocations under each tag get
    pools of their own. A scope inside another of another tag on the same thread routes
    to its own tag's pool while it lasts (Note [one MemPool per thread and device at a
    time], _PoolLease): PyTorch routes a thread to the first pool it entered, so the
    outer one is left meanwhile.

    Note [a MemPool per device]: torch.cuda.MemPool(allocator) hands the allocator to
    c10's caching allocator of the device current when it is made, and only there
    (at::cuda::MemPool's constructor: createOrIncrefPool(current_device(), ...)); entering
    it on another device with use_mem_pool makes a pool of that device's with no
    allocator, served by cudaMalloc, not tidepool. So each device gets pools of its own,
    made with that device current."""
    pools = STATE.pools.setdefault((device, tag), [])
    while len(pools) <= index:
        with STATE.torch.cuda.device(device):
            pools.append(STATE.torch.cuda.MemPool(STATE.allocator.allocator()))
    return pools[index]


def exit_all(contexts: list) -> None:
    """Exits `contexts` (pool leases), innermost first, every one of them even when one
    raises; then raises the first error."""
    error = None
    for context in reversed(contexts):
        try:
            context.__exit__(None, None, None)
        except BaseException as e:  # noqa: BLE001  (raised once the others are exited)
            error = error or e
    if error is not None:
        raise error


def pool_lease(device: int | None, tag: int) -> "_PoolLease":
    """A context manager routing this thread's allocations on `device` to a tidepool
    MemPool for allocations under `tag` (Note [one MemPool per thread and device at a
    time], _PoolLease; Note [a MemPool per tag])."""
    return _PoolLease(device, tag)


class _Lease:
    """One pool a thread routes a device's allocations to: its tag, its index in the tag's
    pool list, the MemPool, how many scopes of the thread hold it, and the use_mem_pool
    context while it is entered (None while a scope of another tag inside it has it left:
    Note [a MemPool per tag])."""

    __slots__ = ("tag", "index", "pool", "depth", "context")

    def __init__(self, tag: int, index: int, pool):
        self.tag, self.index, self.pool = tag, index, pool
        self.depth = 1
        self.context = None

    def enter(self, device: int) -> None:
        # Kept before it is entered: an interrupt once it is would otherwise leave the
        # pool recording with no context to end it.
        self.context = STATE.torch.cuda.use_mem_pool(self.pool, device)
        try:
            self.context.__enter__()
        except BaseException:
            self.context = None  # not entered: nothing to end
            raise

    def leave(self) -> None:
        context, self.context = self.context, None
        if context is not None:
            context.__exit__(None, None, None)


class _PoolLease:
    """Note [one MemPool per thread and device at a time]: PyTorch lets a MemPool record
    one allocating thread per device at a time (torch.cuda.use_mem_pool in a second
    thread, or a second time in one thread, raises "beginAllocateToPool: already recording
    to mempool_id"), and ending it ends the recording of whichever thread began it. So
    two threads in tidepool scopes on one device at once (two models stepped in two
    threads, a tidepool.region() in each) cannot share tidepool's pool. Inside this
    context the calling thread's allocations on `device` (an index; None: the current
    device) go to a tidepool MemPool of the tag's (Note [a MemPool per tag]) that no other
    thread routes that device's allocations to, or holds for later: the first such pool,
    or a new one when all are taken. A scope inside another of the same tag on the same
    thread keeps its pool and enters nothing. One of another tag (an optimizer step inside
    a tidepool.region() around the training loop, a region inside a step) leaves the outer
    pool for its own tag's while it lasts and enters the outer one again when it ends:
    PyTorch routes a thread to the first pool it entered, so keeping the outer one
    entered would put the step's state in the region's pool (never evicted) and the
    region's later tensors in the spare room of state segments. Each thread keeps a stack
    of its leases per device; the pools live as long as the process, like the first one:
    their blocks may outlive any scope; so a process gets as many pools per tag as it has
    threads in scopes of that tag on one device at once, and each caches the segments its
    blocks came from. Scopes closed out of order (a region held by a generator across a
    step, or by asyncio tasks across an await: python/README.md) are said once, and each
    still ends its own lease only.
    An exception on the way in leaves nothing taken and the outer pool entered again."""

    def __init__(self, device: int | None, tag: int):
        self.device = device
        self.tag = tag
        self._key = None
        self._lease = None

    def __enter__(self):
        if STATE.torch.cuda._is_in_bad_fork():
            # A child forked after CUDA was used cannot use it (PyTorch refuses), so it
            # allocates nothing a pool could take: the scope routes nothing, and a
            # tidepool.region() there tags as in the parent (review finding: asking for
            # the current device raised "Cannot re-initialize CUDA in forked subprocess").
            return self
        key = self.device if self.device is not None else STATE.torch.cuda.current_device()
        me = threading.get_ident()
        lease = outer = None
        try:
            with STATE.lock:
                by_thread = STATE.pool_leases.setdefault(key, {})
                stack = by_thread.setdefault(me, [])
                if stack and stack[-1].tag == self.tag:  # routed to this tag's pool already
                    stack[-1].depth += 1
                    self._key, self._lease = key, stack[-1]
                    return self
                taken = {held.index for thread, leases in by_thread.items() if thread != me
                         for held in leases if held.tag == self.tag}
                made = len(STATE.pools.get((key, self.tag), ()))
                index = next(i for i in range(made + 1) if i not in taken)
                lease = _Lease(self.tag, index, _pool_locked(key, self.tag, index))
                stack.append(lease)
                outer = stack[-2] if len(stack) > 1 else None
            if outer is not None:
                outer.leave()
            lease.enter(key)
        except BaseException:
            if lease is not None:
                self._close(key, me, lease, resume=outer)
            else:
                self._release(key, me)
            raise
        self._key, self._lease = key, lease
        return self

    def __exit__(self, *exc):
        key, self._key = self._key, None
        lease, self._lease = self._lease, None
        if lease is None:  # entered in a forked child: routed nothing
            return False
        me = threading.get_ident()
        with STATE.lock:
            stack = STATE.pool_leases[key][me]
            lease.depth -= 1
            if lease.depth > 0:  # another scope of this thread's still routes to it
                return False
            innermost = stack[-1] is lease
            outer = stack[-2] if innermost and len(stack) > 1 else None
        if not innermost:
            _say_out_of_order()
        self._close(key, me, lease, resume=outer)
        return False

    def _close(self, key: int, me: int, lease: _Lease, resume: _Lease | None) -> None:
        """Takes `lease` off the thread's stack and ends it; then `resume` (the lease below
        it, when it was the innermost) routes again."""
        with STATE.lock:
            stack = STATE.pool_leases.get(key, {}).get(me, [])
            if lease in stack:
                stack.remove(lease)
        try:
            lease.leave()
        finally:
            try:
                if resume is not None and resume.context is None:
                    resume.enter(key)
            finally:
                self._release(key, me)

    @staticmethod
    def _release(key: int, me: int) -> None:
        """Forgets the thread's stack of leases on `key` once it is empty."""
        with STATE.lock:
            by_thread = STATE.pool_leases.get(key, {})
            if not by_thread.get(me):
                by_thread.pop(me, None)
            if not by_thread:
                STATE.pool_leases.pop(key, None)


_said_out_of_order = threading.Event()


def _say_out_of_order() -> None:
    if _said_out_of_order.is_set():
        return
    _said_out_of_order.set()
    import warnings

    warnings.warn(
        "tidepool: scopes on one thread closed out of order (a tidepool.region() held by a "
        "generator across an optimizer step, or by asyncio tasks across an await); each "
        "ended its own MemPool lease, but the allocations in between may have gone to "
        "another tag's pool (said once)", RuntimeWarning, stacklevel=3)
