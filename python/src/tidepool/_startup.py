"""Claims tidepool's configuration at start-up and installs tidepool when torch is
imported, before CUDA initialises.

Order of events in a process started with PYTORCH_CUDA_ALLOC_CONF=backend:tidepool,...:
  1. site runs tidepool_autoload.pth -> tidepool._autoload -> start() here;
  2. start() lets libtidepool claim the tidepool keys (tidepool::install_from_env): the
     variable now holds only PyTorch's own entries, so PyTorch will accept it;
  3. start() puts a finder at the front of sys.meta_path that waits for `import torch`
     (it never imports torch itself);
  4. when torch's own module has finished executing, the finder's loader calls
     _install.install(torch): the pluggable allocator or the MemPool, and the global
     optimizer step hooks. CUDA is not initialised by `import torch`, so this is in time.
Under LD_PRELOAD=libtidepool_preload.so the shim has done step 2 and serves cudaMalloc;
the hook then stands aside, unless the shim turned itself off (no CUDA runtime of its
major, no libtidepool: it said why), leaving the keys for the hook to claim.
A configuration error found in step 2 is raised at step 4 as tidepool.ConfigError, from
`import torch`, so a training script stops at once with the message; other Python
programs that never import torch (pip, tools) are left alone.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
import threading

from . import _install, _lib

_error: BaseException | None = None
_config: dict | None = None
_finder: "_TorchImportFinder | None" = None


def preload_shim_in_charge() -> bool:
    """True when libtidepool_preload.so is mapped into this process (LD_PRELOAD) and has not
    turned itself off: it claimed the keys and serves cudaMalloc, or it sets up at the first
    cudaMalloc. A shim that is off left the keys in the variables, where PyTorch would
    reject them: the hook claims them then. A shim not set up yet while PyTorch's
    variables name tidepool (set at run time: at start-up the shim would have claimed
    them) sets up now, so that the keys are claimed before PyTorch reads them; the keys
    are checked first, so that a bad one is a ConfigError here, not the shim ending the
    process at its set-up."""
    try:
        with open("/proc/self/maps") as maps:
            if not any("libtidepool_preload" in line for line in maps):
                return False
    except OSError:
        return False
    current = _shim_call("tidepool_preload_state")
    if current is None:
        return True  # mapped but not in the global scope: not the LD_PRELOAD shim's set-up
    if current != -1:
        return current != 0
    from . import _config
    if any("tidepool" in os.environ.get(variable, "") for variable in _config.VARIABLES):
        _config.plan_for_preload()  # raises ConfigError naming the bad key, by the shim's rules
        current = _set_up_shim()
    return current != 0


def _shim_call(name: str) -> int | None:
    """The LD_PRELOAD shim's `name()` (tidepool_preload_state, tidepool_preload_set_up:
    1 serves, 0 off, -1 not set up yet), or None when no shim's symbols are in the
    process's global scope."""
    import ctypes

    try:
        fn = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = []
    return fn()


def _set_up_shim() -> int | None:
    """Sets the LD_PRELOAD shim up now (tidepool_preload_set_up) and brings os.environ in
    line with the variables it rewrote; returns its state (1 serves, 0 off)."""
    from . import _config
    current = _shim_call("tidepool_preload_set_up")
    _config.sync_environ()
    return current


def preload_shim_waiting() -> bool:
    """True under an LD_PRELOAD shim that is not set up yet: nothing named tidepool at
    start-up, and no cudaMalloc since (it sets up at the first)."""
    return _shim_call("tidepool_preload_state") == -1


def set_up_preload_shim_with(conf: str, config: dict) -> bool:
    """For tidepool.install(conf) under a shim still waiting (preload_shim_waiting): the
    shim sets up now and serves with `conf` (its parsed `config`), put in
    TIDEPOOL_ALLOC_CONF as a child process would inherit it, unless the environment gives
    the shim a configuration already, which must then be conf's (ConfigError otherwise;
    also for a conf the shim's rules refuse, which would end the process at its set-up).
    True when the shim serves; False when it turned itself off (it said why): the hook
    installs tidepool then, and TIDEPOOL_ALLOC_CONF is as it was."""
    from . import _config
    named, planned = _config.plan_for_preload()
    if named and planned != config:
        raise _config.ConfigError(
            f"tidepool.install(): the LD_PRELOAD shim serves tidepool with the configuration "
            f"the environment gives it (PYTORCH_ALLOC_CONF, PYTORCH_CUDA_ALLOC_CONF or "
            f"TIDEPOOL_ALLOC_CONF); {conf!r} differs from it")
    inherited = os.environ.get("TIDEPOOL_ALLOC_CONF")
    state = None
    try:
        if not named:
            os.environ["TIDEPOOL_ALLOC_CONF"] = conf
            _config.plan_for_preload()  # conf by the shim's rules, next to PyTorch's variables
        state = _set_up_shim()
        # A cudaMalloc on another thread may have set the shim up in between, with what
        # the environment held then.
        if state == 1 and _config.active_config() != config:
            state = None
            raise _config.ConfigError(
                f"tidepool.install(): the LD_PRELOAD shim set itself up meanwhile (a CUDA "
                f"allocation on another thread) with {_config.active_config()}; {conf!r} "
                "cannot change it")
    finally:
        # Whatever went wrong (an interrupt too), conf stays only with a shim serving it.
        if state != 1 and not named:
            _restore_inherited(inherited)
    return state == 1


def _restore_inherited(value: str | None) -> None:
    if value is None:
        os.environ.pop("TIDEPOOL_ALLOC_CONF", None)
    else:
        os.environ["TIDEPOOL_ALLOC_CONF"] = value


def start() -> None:
    """Claims the environment and arranges installation at `import torch`."""
    global _error, _config, _finder
    from . import _config as config_module
    from ._lib import LibraryError

    # A call after a failed one (tidepool.install() once the environment is fixed) starts
    # afresh: the earlier error is not this configuration's.
    _error = _config = None
    try:
        if preload_shim_in_charge():
            # A shim still waiting sets up at the first cudaMalloc and ends the process on
            # a configuration it cannot apply (an inherited TIDEPOOL_ALLOC_CONF with a bad
            # key, or next to expandable_segments:True): checked now by its rules, so that
            # it is a ConfigError at `import torch`, as the hook's own errors are.
            if preload_shim_waiting():
                config_module.plan_for_preload()
            # The shim claimed the keys (or will) and serves cudaMalloc; PyTorch's
            # allocator stays in place on top of it, as the user asked by preloading.
            _install.STATE.status = (
                "active: through the LD_PRELOAD shim (libtidepool_preload.so)")
            return
        if config_module.install_from_env():
            _config = config_module.active_config()
    except (config_module.ConfigError, LibraryError) as e:
        _error = e
        _install.STATE.status = f"failed: {e}"
    if _config is None and _error is None:
        # The variable mentioned "tidepool" but named no tidepool key (or, on a call
        # after a failed one, the environment names tidepool no more): nothing to
        # install at `import torch`.
        _remove_finder()
        return
    if "torch" in sys.modules:
        on_torch_imported(sys.modules["torch"])
    elif _finder is None:
        _finder = _TorchImportFinder()
        sys.meta_path.insert(0, _finder)


def error_pending() -> bool:
    """Whether the configuration read at start-up was in error (the finder raises it at
    every `import torch` until start() reads a fixed environment)."""
    return _error is not None


def on_torch_imported(torch) -> None:
    if _error is not None:
        from ._config import ConfigError

        if isinstance(_error, ConfigError):
            raise ConfigError(str(_error)) from None
        # A missing or broken library stays a LibraryError (a RuntimeError), the type
        # tidepool.install() raises for it, so that one `except` catches both ways in.
        error_type = _lib.LibraryError if isinstance(_error, _lib.LibraryError) else RuntimeError
        raise error_type(
            f"tidepool: the allocator configuration names tidepool, but {_error}") from None
    _install.install(torch, _config)


def _remove_finder() -> None:
    global _finder
    if _finder is not None and _finder in sys.meta_path:
        sys.meta_path.remove(_finder)
    _finder = None


# Note [the import hook]: the finder stays at the front of sys.meta_path until torch has
# really been executed, not merely looked for: importlib.util.find_spec("torch") (how
# transformers and others ask whether torch is installed) runs the finders without
# importing, and a one-shot finder spent there would let the real `import torch` run
# without tidepool. While the configuration is in error the finder stays for good, so
# every `import torch` raises it (a retry in a notebook does not quietly go on without
# tidepool). And once torch has run, whatever fails in tidepool's installation must not
# make torch unimportable: importlib drops a module whose loader raised, and executing
# torch a second time fails ("Only a single TORCH_LIBRARY ..."), so the finder keeps the
# executed module and hands it back at the next `import torch` (with tidepool not
# installed: status() says why).
_torch_after_failure = None  # torch, executed, when tidepool's installation raised
_searching = threading.local()  # this thread is inside the finder's own find_spec


class _PostImportLoader(importlib.abc.Loader):
    """Runs torch's own loader, then tidepool's installation."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        global _torch_after_failure
        # Give torch its real loader back first, so nothing downstream sees this wrapper.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        if _error is not None:
            on_torch_imported(module)  # raises before torch runs
        self._loader.exec_module(module)
        try:
            on_torch_imported(module)  # a failure there sets status() (_install.install)
        except BaseException:
            _torch_after_failure = module
            raise
        _remove_finder()


class _ExecutedTorchLoader(importlib.abc.Loader):
    """Hands back the torch module that already ran (Note [the import hook])."""

    def __init__(self, module):
        self._module = module
        self._spec = module.__spec__

    def create_module(self, spec):
        return self._module

    def exec_module(self, module):
        global _torch_after_failure
        module.__spec__ = self._spec  # importlib set the finder's spec on it
        module.__loader__ = self._spec.loader
        _torch_after_failure = None
        _remove_finder()


def _named_since_start() -> bool:
    """Whether PyTorch's variables mention tidepool again after start() claimed them."""
    from . import _config as config_module
    return any("tidepool" in os.environ.get(variable, "")
               for variable in config_module.VARIABLES)


class _TorchImportFinder(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of `torch` that the other finders find.

    Note [named again before import torch]: the keys claimed at start-up may come from
    TIDEPOOL_ALLOC_CONF (inherited from a parent), and the script may then set PyTorch's
    variables itself before it imports torch: torch.multiprocessing.spawn's workers run
    the parent's main module again, whose os.environ["PYTORCH_CUDA_ALLOC_CONF"] =
    "backend:tidepool" line did that. Nothing claimed those keys, and PyTorch refused
    them (review finding). So the variables are looked at again when torch is looked
    for, and keys found there are claimed as at start-up (PyTorch's variables win over an
    inherited TIDEPOOL_ALLOC_CONF)."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch" or getattr(_searching, "active", False):
            return None
        if _torch_after_failure is not None:
            executed = _torch_after_failure.__spec__
            return importlib.util.spec_from_loader(
                "torch", _ExecutedTorchLoader(_torch_after_failure), origin=executed.origin,
                is_package=True)
        if _named_since_start():
            start()
            if _finder is not self:  # nothing to install any more
                return None
        _searching.active = True
        try:
            spec = importlib.util.find_spec("torch")
        finally:
            _searching.active = False
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PostImportLoader(spec.loader)
        return spec
