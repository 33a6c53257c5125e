"""What the tests of tidepool.optim share: they are skipped, saying why, where the binding
tidepool._optim is not built (a build without Python's headers; ctest sets
TIDEPOOL_OPTIM_MODULE to the built one)."""

from __future__ import annotations

import pytest

from tidepool import _lib


def skip_without_binding() -> None:
    """Skips the calling test module when tidepool._optim cannot be found."""
    try:
        _lib.optim_module_path()
    except _lib.LibraryError as e:  # pragma: no cover - depends on the build
        pytest.skip(f"tidepool._optim is not built: {e}", allow_module_level=True)
