"""What the randomized Python tests share with the C++ ones (tests/support/test_seed.h,
test_scale.h): TIDEPOOL_TEST_SEED draws other sequences than CI's fixed ones, and
TIDEPOOL_TEST_SCALE makes them longer (or shorter)."""

from __future__ import annotations

import os


def seeds(count: int) -> list[int]:
    """`count` seeds: CI's fixed ones, or others for each TIDEPOOL_TEST_SEED value."""
    override = os.environ.get("TIDEPOOL_TEST_SEED", "")
    base = int(override) if override.isdigit() and int(override) > 0 else 0
    return [base * 1000 + i for i in range(1, count + 1)]


def scaled(n: int) -> int:
    """`n` times TIDEPOOL_TEST_SCALE (unset, empty, not a number or not positive: 1), at
    least 1."""
    try:
        scale = float(os.environ.get("TIDEPOOL_TEST_SCALE", "1"))
    except ValueError:
        scale = 1.0
    return max(1, int(n * (scale if scale > 0 else 1.0)))
