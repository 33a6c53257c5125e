"""Start-up hook, imported by tidepool_autoload.pth in every Python process.

It must cost next to nothing when tidepool is not asked for: one look at two
environment variables, no ctypes, no torch. Only when PYTORCH_CUDA_ALLOC_CONF or
PYTORCH_ALLOC_CONF mentions tidepool, or TIDEPOOL_ALLOC_CONF is set, does it load the library
and claim the keys (tidepool._startup). TIDEPOOL_AUTOLOAD=0 turns the hook off.
"""

import os as _os


def _named() -> bool:
    # TIDEPOOL_ALLOC_CONF: the keys a parent process claimed (or set by hand).
    return bool(_os.environ.get("TIDEPOOL_ALLOC_CONF")) or any(
        "tidepool" in _os.environ.get(name, "")
        for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"))


if _os.environ.get("TIDEPOOL_AUTOLOAD", "1") != "0" and _named():
    from . import _startup

    _startup.start()
