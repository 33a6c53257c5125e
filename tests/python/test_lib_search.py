"""Where tidepool looks for the CUDA runtime of PyPI's nvidia wheel (_lib.
preload_wheel_cudart): on sys.path, and in the site folders that join it only after the
start-up hook ran (pip install --user; a venv's base with --system-site-packages)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

from tidepool import _lib


def a_harmless_library() -> str:
    """A real shared library that is safe to load twice (a copy stands in for libcudart)."""
    import ctypes.util
    name = ctypes.util.find_library("m")
    for folder in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64"):
        path = os.path.join(folder, name or "libm.so.6")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError("no libm to stand in for libcudart")


def test_the_runtime_is_found_in_a_site_folder_not_yet_on_sys_path(tmp_path):
    """Review finding: only sys.path as it stood while the .pth files ran was searched,
    and libtidepool then failed on its missing runtime."""
    lib = tmp_path / "user-site" / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    shutil.copy(a_harmless_library(), lib / _lib._CUDART_SONAME)
    code = textwrap.dedent(f"""
        import site, sys
        from tidepool import _lib
        # As at start-up in a process whose runtime lies only in the user's site folder.
        sys.path[:] = [p for p in sys.path if "site-packages" not in p]
        site.getsitepackages = lambda: []
        site.getusersitepackages = lambda: {str(tmp_path / "user-site")!r}
        site.ENABLE_USER_SITE = True
        print(_lib.preload_wheel_cudart())
        site.ENABLE_USER_SITE = False  # python -s: the user's folder is not to be used
        print(_lib.preload_wheel_cudart())
    """)
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(_lib.__file__)),
               TIDEPOOL_AUTOLOAD="0")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(lib / _lib._CUDART_SONAME), "None"]
