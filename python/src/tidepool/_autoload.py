"""Start-up hook, imported by tidepool_autoload.pth in every Python process.

It must cost next to nothing when tidepool is not asked for: one look at two
environment variables, no ctypes, no torch. Only when PYTORCH_CUDA_ALLOC_CONF or
PYTORCH_ALLOC_CONF mentions tidepool, or TIDEPOOL_ALLOC_CONF is set, does it load the library
and claim the keys (tidepool._startup). Otherwise it waits for `import torch` and looks
again then (Note [named after start-up]). TIDEPOOL_AUTOLOAD=0 (or false, off, no) turns
the hook off.
"""

import os as _os
import sys as _sys


def _named() -> bool:
    # TIDEPOOL_ALLOC_CONF: the keys a parent process claimed (or set by hand).
    # A blank one is unset (config.cpp's plan_from_env says why).
    return bool(_os.environ.get("TIDEPOOL_ALLOC_CONF", "").strip(" \t\r\n,")) or any(
        "tidepool" in _os.environ.get(name, "")
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))


class _NamedAtTorchImport:
    """Note [named after start-up]: a script may set PYTORCH_CUDA_ALLOC_CONF itself before
    it imports torch (os.environ[...] = "backend:tidepool", a common idiom), after this
    hook ran. So when the variables named no tidepool key at start-up, this finder waits
    at the front of sys.meta_path for the first `import torch` and looks at them again
    then: named now, the hook starts as it would have at start-up, and the import goes
    through its finder (review finding: the keys went unclaimed, PyTorch was left to
    refuse them, and status() said no tidepool key was named). It finds nothing itself
    and costs one comparison per import. It stays while torch is only looked for
    (importlib.util.find_spec("torch"), as transformers asks) or imported with nothing
    named, and leaves when it hands over, or when it finds torch imported already."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        if "torch" in _sys.modules:
            self._leave()
            return None
        if not _named():
            return None
        self._leave()
        from . import _startup

        _startup.start()
        finder = _startup._finder
        return None if finder is None else finder.find_spec(fullname, path, target)

    def _leave(self) -> None:
        if self in _sys.meta_path:
            _sys.meta_path.remove(self)


if _os.environ.get("TIDEPOOL_AUTOLOAD", "1").strip().lower() not in ("0", "false", "off", "no"):
    if _named():
        from . import _startup

        try:
            _startup.start()
        except Exception as _e:  # noqa: BLE001
            if "torch" not in _sys.modules:
                raise  # site says it and goes on, as for any .pth; `import torch` will fail
            # torch was imported already (by a .pth read before this one): start()
            # installed at once, and its error cannot wait for `import torch`. Raised
            # here, site would print it and go on, the keys claimed and tidepool not
            # installed (review finding); stopped, as `import torch` would stop it. Not by
            # SystemExit, which site turns into a fatal error of the interpreter's start.
            print(f"tidepool: {type(_e).__name__}: {_e}", file=_sys.stderr, flush=True)
            _os._exit(1)
    elif "torch" not in _sys.modules:
        _sys.meta_path.insert(0, _NamedAtTorchImport())
