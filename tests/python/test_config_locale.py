"""The configuration reads and writes numbers the same way in every locale: a program
that calls setlocale(LC_ALL, "") in a locale with a decimal comma (de_DE) must still get
1.5GiB as 1.5 GiB, and JSON Python can read. Before, strtod and printf followed
LC_NUMERIC: 1.5GiB became 1 GiB, 0.5MiB became 0, and 12.5% was written as "0,125"."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from conftest import clean_env

PROGRAM = """
import json, locale
locale.setlocale(locale.LC_ALL, "de_DE.UTF-8")
assert locale.localeconv()["decimal_point"] == ","
from tidepool import _config
out = {}
c = _config.apply("tidepool.state_budget:1.5GiB,tidepool.tier_min_bytes:0.5MiB")
out["state_budget"] = c["state_budget"]
out["tier_min_bytes"] = c["tier_min_bytes"]
out["percent"] = _config.apply("tidepool.state_budget:12.5%")["state_budget"]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def german_locale(tmp_path_factory):
    """A directory holding de_DE.UTF-8, compiled by localedef (no locale is installed on
    a bare machine)."""
    localedef = shutil.which("localedef")
    if localedef is None:
        pytest.skip("localedef is not installed")
    where = tmp_path_factory.mktemp("locales")
    made = subprocess.run([localedef, "-i", "de_DE", "-f", "UTF-8", str(where / "de_DE.UTF-8")],
                          capture_output=True, text=True)
    if not (where / "de_DE.UTF-8").is_dir():
        pytest.skip(f"localedef cannot make de_DE.UTF-8: {made.stderr.strip()}")
    return where


def test_sizes_and_percentages_keep_their_fractions_in_a_decimal_comma_locale(german_locale):
    result = subprocess.run([sys.executable, "-c", PROGRAM],
                            env=clean_env(LOCPATH=str(german_locale)),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out == {"state_budget": {"kind": "bytes", "bytes": 3 << 29},
                   "tier_min_bytes": 1 << 19,
                   "percent": {"kind": "fraction", "fraction": 0.125}}
