"""Shared set-up for the Python package's tests.

The tests run against a built libtidepool.so named by TIDEPOOL_LIBRARY (ctest sets it,
see CMakeLists.txt here) and the package sources in python/src. Subprocess tests start
a fresh interpreter whose site directory holds a copy of the real
python/tidepool_autoload.pth, so the start-up hook runs exactly as it does for an
installed package.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE_SRC = REPO / "python" / "src"
PTH_FILE = REPO / "python" / "tidepool_autoload.pth"

sys.path.insert(0, str(PACKAGE_SRC))


def pytest_sessionstart(session):
    # Load libtidepool before any test imports torch: the order of a real process, where
    # the start-up hook loads it first (other orders: test_load_order.py).
    if os.environ.get("TIDEPOOL_LIBRARY"):
        from tidepool import _lib
        _lib.load()


def pytest_configure(config):
    if not os.environ.get("TIDEPOOL_LIBRARY"):
        raise pytest.UsageError(
            "set TIDEPOOL_LIBRARY to a built libtidepool.so (ctest does: "
            "`ctest -R python_pytest` in a build directory)")


def host_backend_script(body: str, keys: str = "") -> str:
    """Code for run_python: libtidepool on its host backend ("device" memory is host RAM,
    readable through the pointers), with the tidepool.* `keys` ("tidepool.state_budget:
    5MiB"), and `malloc(bytes)`, the allocator entry point the package hands PyTorch, on
    device 0 (under tidepool.region("optimizer_state") it makes pointer-stable ranges);
    then `body`."""
    conf = ",".join(["backend:tidepool", "tidepool.device_backend:host"] + ([keys] if keys else []))
    return textwrap.dedent(f"""
        import ctypes, json
        import tidepool
        from tidepool import _config, _lib, _tiering
        _config.apply({conf!r})
        _malloc = getattr(_lib.load(), _lib.PYTORCH_ENTRY_POINTS[0])
        _malloc.restype = ctypes.c_void_p
        _malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
        def malloc(n):
            return _malloc(n, 0, None)
        MiB = 1 << 20
        """) + textwrap.dedent(body)


@pytest.fixture(scope="session")
def site_dir(tmp_path_factory) -> Path:
    """A directory holding the real .pth file, to be added as a site directory."""
    d = tmp_path_factory.mktemp("site")
    shutil.copy(PTH_FILE, d / PTH_FILE.name)
    return d


def clean_env(**variables: str) -> dict:
    """The test process's environment without anything that would steer tidepool or
    PyTorch's allocator, plus `variables`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "TIDEPOOL_ALLOC_CONF",
                        "LD_PRELOAD", "TIDEPOOL_AUTOLOAD", "TIDEPOOL_BACKEND", "TIDEPOOL_CUDART",
                        "PYTHONWARNINGS")}
    env["PYTHONPATH"] = str(PACKAGE_SRC)
    env.update(variables)
    return env


@pytest.fixture
def run_python(site_dir):
    """Runs `code` in a fresh interpreter that processes the .pth at start-up, as site
    does for site-packages. Returns the CompletedProcess (text); raises
    subprocess.TimeoutExpired after `timeout` seconds."""

    def run(code: str, *, check: bool = True, preload: str | None = None, hook_first: bool = True,
            timeout: float = 120, **variables):
        # SITE_DIR lets a test process the .pth itself, later (hook_first=False).
        prologue = f"import site; SITE_DIR = {str(site_dir)!r}\n"
        if hook_first:
            prologue += "site.addsitedir(SITE_DIR)\n"
        env = clean_env(**variables)
        if preload:
            env["LD_PRELOAD"] = preload
        result = subprocess.run([sys.executable, "-c", prologue + textwrap.dedent(code)],
                                env=env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise AssertionError(f"subprocess failed ({result.returncode}):\n"
                                 f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
        return result

    return run
