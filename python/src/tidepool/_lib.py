"""Finds and loads libtidepool.so and declares its C ABI for ctypes.

Everything the package does goes through this C ABI (allocator/c_api.h,
allocator/config.h, and the tiering functions when the build has them), so Python,
the LD_PRELOAD shim and C++ trainers share one implementation.

Where the library is:
  1. $TIDEPOOL_LIBRARY (a path to libtidepool.so), for tests and development builds;
  2. the copy installed with this package (tidepool/lib/libtidepool.so*).
PyTorch's CUDAPluggableAllocator is handed the same library (PYTORCH_ENTRY_POINTS in
global mode, POOL_ENTRY_POINTS for pool mode's MemPool).
Global mode prefers libtidepool_torch_cuda.so (load_torch_cuda), found the same way
($TIDEPOOL_TORCH_CUDA_LIBRARY, then tidepool/lib/).

libtidepool.so needs libcudart.so.13 when it was built with CUDA. PyPI's torch keeps
that in site-packages/nvidia/cu13/lib, which is not on the loader's search path, so
the loader loads that copy first (RTLD_GLOBAL). The dynamic loader then resolves
libtidepool's dependency by its soname to the very file torch itself uses later.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
import threading

__all__ = ["LibraryError", "PYTORCH_ENTRY_POINTS", "POOL_ENTRY_POINTS", "library_path", "load",
           "optional", "check", "last_error", "torch_cuda_library_path", "load_torch_cuda",
           "optim_module_path"]


class LibraryError(RuntimeError):
    """libtidepool.so could not be found or loaded, or lacks a function."""


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_CUDART_SONAME = "libcudart.so.13"

# The malloc/free pair of libtidepool.so for torch.cuda.memory.CUDAPluggableAllocator:
# they route optimizer state to pointer-stable ranges and, unlike tidepool_malloc, throw
# tidepool's message on failure (PyTorch does not check for NULL; Note [OOM into
# PyTorch] in allocator/c_api.h).
PYTORCH_ENTRY_POINTS = ("tidepool_pytorch_malloc", "tidepool_pytorch_free")
# A MemPool's allocator is checked for NULL by PyTorch's caching allocator, which then frees
# its own cached blocks, retries and raises torch.OutOfMemoryError: pool mode hands it the
# pair whose malloc returns NULL for out of memory only (and throws tidepool's message for
# any other failure), Note [OOM into a MemPool] in allocator/c_api.h.
POOL_ENTRY_POINTS = ("tidepool_pytorch_pool_malloc", "tidepool_pytorch_free")


def _find_library(variable: str, name: str) -> str | None:
    """$variable when set (it must name a file), else the copy of `name` installed with
    this package (tidepool/lib/name*, the shortest name: the unversioned one), else None."""
    override = os.environ.get(variable)
    if override:
        if not os.path.isfile(override):
            raise LibraryError(f"{variable}={override!r} is not a file")
        return os.path.abspath(override)
    candidates = sorted(glob.glob(os.path.join(_PACKAGE_DIR, "lib", name + "*")), key=len)
    return candidates[0] if candidates else None


def library_path() -> str:
    """Absolute path of the libtidepool.so this process uses (or would use)."""
    # Once loaded, that copy: looked up again, a TIDEPOOL_LIBRARY changed since (or a
    # relative one after a chdir) would name another library, and PyTorch would dlopen a
    # second libtidepool with none of this one's configuration or tags.
    loaded = _lib
    if loaded is not None:
        return loaded._name
    path = _find_library("TIDEPOOL_LIBRARY", "libtidepool.so")
    if path is None:
        raise LibraryError(
            f"libtidepool.so is not installed in {os.path.join(_PACKAGE_DIR, 'lib')}; "
            "install the package with `pip install --no-build-isolation ./python` or set "
            "TIDEPOOL_LIBRARY to a built libtidepool.so")
    return path


def torch_cuda_library_path() -> str | None:
    """libtidepool_torch_cuda.so (optimizers/install/torch_cuda_allocator.h): tidepool as
    c10's CUDA allocator with cacheInfo and record_stream connected, built against the
    torch the package was built with. $TIDEPOOL_TORCH_CUDA_LIBRARY (tests and development
    builds; set but empty means none), else the copy installed with the package, else None
    (a build without torch at build time, see python/CMakeLists.txt)."""
    if os.environ.get("TIDEPOOL_TORCH_CUDA_LIBRARY") == "":
        return None
    return _find_library("TIDEPOOL_TORCH_CUDA_LIBRARY", "libtidepool_torch_cuda.so")


def optim_module_path() -> str:
    """tidepool._optim (python/binding/optim_module.cpp), the binding tidepool.optim
    loads: $TIDEPOOL_OPTIM_MODULE (tests and development builds), else the copy installed
    with the package. Raises LibraryError when there is none."""
    path = _find_library("TIDEPOOL_OPTIM_MODULE", "_optim")
    if path is None:
        raise LibraryError(
            f"tidepool.optim's binding (_optim*.so) is not installed in "
            f"{os.path.join(_PACKAGE_DIR, 'lib')}: the package was built without torch or "
            "without Python's headers; install it with `pip install --no-build-isolation "
            "./python` from a Python that has torch, or set TIDEPOOL_OPTIM_MODULE to a "
            "built _optim module")
    return path


def load_torch_cuda() -> tuple[ctypes.CDLL | None, str]:
    """(library, "") for torch_cuda_library_path(), or (None, why not). Call it after
    `import torch`: the library's LibTorch dependencies resolve to the copies torch has
    loaded. One that does not load (built against another torch) is a reason, not an
    error: the caller falls back to torch's CUDAPluggableAllocator class."""
    path = torch_cuda_library_path()
    if path is None:
        return None, ("libtidepool_torch_cuda.so is not installed "
                      "(the package was built without torch)")
    load()  # its dependency on libtidepool resolves to the copy this package uses
    try:
        shim = ctypes.CDLL(path)
    except OSError as e:
        return None, f"cannot load {path} ({e}); rebuild the package against this torch"
    # Note [one torch for libtidepool_torch_cuda]: its allocator subclasses c10's, whose
    # layout and virtual methods change between releases; under another torch every symbol
    # may still resolve while c10 calls the wrong methods. So it is used only under the
    # torch it was built against.
    import torch
    built_for = getattr(shim, "tidepool_torch_cuda_built_for", None)
    running = torch.__version__.split("+")[0]
    if built_for is None:
        return None, (f"{path} does not say which torch it was built against (an older "
                      f"build); rebuild the package against this torch ({running})")
    built_for.restype, built_for.argtypes = ctypes.c_char_p, []
    built = built_for().decode()
    if built != running:
        return None, (f"{path} was built against torch {built}, but this is torch {running}; "
                      "rebuild the package against this torch")
    fn = getattr(shim, "tidepool_torch_install_cuda_allocator", None)
    if fn is None:
        return None, f"{path} lacks tidepool_torch_install_cuda_allocator"
    fn.restype, fn.argtypes = ctypes.c_int, []
    return shim, ""


def _site_folders() -> list:
    """sys.path, then the site folders not on it yet: at start-up the .pth files of one
    folder run before the later folders join sys.path (the user's, with pip install
    --user; a venv's base with --system-site-packages), and the nvidia wheel may be in
    one of those (review finding: libtidepool then failed on its missing runtime)."""
    import site
    folders = list(sys.path)
    try:
        later = site.getsitepackages()
        if site.ENABLE_USER_SITE:  # not with python -s, PYTHONNOUSERSITE, an isolated venv
            later = later + [site.getusersitepackages()]
    except AttributeError:  # a virtualenv's older site module lacks them
        later = []
    return folders + [f for f in later if f not in folders]


def preload_wheel_cudart() -> str | None:
    """Loads libcudart from PyPI's nvidia wheel, if present and not loaded yet."""
    for entry in _site_folders():
        path = os.path.join(entry or ".", "nvidia", "cu13", "lib", _CUDART_SONAME)
        if os.path.isfile(path):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                return None
            return path
    return None


# Note [load mode]: RTLD_GLOBAL, whatever was imported before, so that the LD_PRELOAD
# shim, PyTorch's CUDAPluggableAllocator and this package all see one libtidepool. That is safe
# because libtidepool exports no allocator into the process: it does not link
# Debian's malloc-overriding libmimalloc.so.2 but dlopen()s it RTLD_LOCAL for the pinned
# host arena (tiering/host_arena.cpp). tests/python/test_load_order.py loads it before
# and after torch, then imports triton, which is where two allocators used to crash.
_LOAD_MODE = ctypes.RTLD_GLOBAL


# name -> (restype, argtypes). Functions every build has.
_REQUIRED = {
    "tidepool_config_claim": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t,
                                             ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                             ctypes.c_size_t]),
    "tidepool_config_apply": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "tidepool_config_active_json": (ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
    "tidepool_install_from_env": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t]),
    "tidepool_config_plan_for_preload": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_size_t,
                                                        ctypes.c_char_p, ctypes.c_size_t]),
}
# Functions of the allocator's C ABI; looked up lazily so that a partial build still
# claims configuration and reports what is missing when it is used.
_ALLOCATOR = {
    "tidepool_malloc": (ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]),
    "tidepool_free": (None, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]),
    "tidepool_pytorch_record_stream": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p]),
    "tidepool_empty_cache": (ctypes.c_int, [ctypes.c_int]),
    "tidepool_empty_cache_all": (ctypes.c_int, []),
    "tidepool_cache_info": (ctypes.c_int, [ctypes.c_int, ctypes.POINTER(ctypes.c_size_t)]),
    "tidepool_set_memory_fraction": (ctypes.c_int, [ctypes.c_double, ctypes.c_int]),
    "tidepool_get_memory_fraction": (ctypes.c_double, [ctypes.c_int]),
    "tidepool_enable_peer_access": (ctypes.c_int, [ctypes.c_int, ctypes.c_int]),
    "tidepool_tag_id": (ctypes.c_int, [ctypes.c_char_p]),
    "tidepool_tag_name": (ctypes.c_char_p, [ctypes.c_int]),
    "tidepool_tag_push": (ctypes.c_int, [ctypes.c_int]),
    "tidepool_tag_pop": (ctypes.c_int, []),
    "tidepool_tag_current": (ctypes.c_int, []),
    "tidepool_get_stats_v1": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]),
    "tidepool_reset_peak_stats": (ctypes.c_int, [ctypes.c_int]),
    "tidepool_get_pytorch_stats_v1": (ctypes.c_int, [ctypes.c_int, ctypes.c_void_p]),
    "tidepool_pytorch_reset_accumulated_stats": (ctypes.c_int, [ctypes.c_int]),
    "tidepool_snapshot_json": (ctypes.c_void_p, [ctypes.c_int]),
    "tidepool_string_free": (None, [ctypes.c_void_p]),
    "tidepool_last_error": (ctypes.c_char_p, []),
    "tidepool_clear_error": (None, []),
    "tidepool_set_backend": (ctypes.c_int, [ctypes.c_char_p]),
    "tidepool_backend_name": (ctypes.c_char_p, [ctypes.c_int]),
}


def load() -> ctypes.CDLL:
    """The loaded library (loads it on first use). Raises LibraryError."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        preload_wheel_cudart()
        try:
            lib = ctypes.CDLL(path, mode=_LOAD_MODE)
        except OSError as e:
            raise LibraryError(f"cannot load {path}: {e}") from e
        for name, (restype, argtypes) in _REQUIRED.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise LibraryError(
                    f"{path} lacks {name}; it is not a matching libtidepool build") from None
            fn.restype, fn.argtypes = restype, argtypes
        for name, (restype, argtypes) in _ALLOCATOR.items():
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype, fn.argtypes = restype, argtypes
        _lib = lib
        return lib


def optional(name: str):
    """The C function `name`, or None when this build does not have it."""
    return getattr(load(), name, None)


def function(name: str, what: str):
    """The C function `name`; raises LibraryError naming `what` when the build lacks it."""
    fn = optional(name)
    if fn is None:
        raise LibraryError(
            f"{what} is not available in this build of libtidepool ({name} is missing)")
    return fn


def last_error() -> str:
    fn = optional("tidepool_last_error")
    if fn is None:
        return ""
    message = fn()
    return message.decode("utf-8", "replace") if message else ""


def check(status: int, what: str) -> int:
    """Raises RuntimeError with tidepool's last error when a C call returned < 0."""
    if status < 0:
        detail = last_error()
        raise RuntimeError(f"tidepool: {what} failed" + (f": {detail}" if detail else ""))
    return status
