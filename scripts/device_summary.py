#!/usr/bin/env python3
"""The short table scripts/device-check prints at its end: one line per benchmark row of
the run, from the Google Benchmark JSON files it wrote (a run cut short by its cap, whose
JSON never closed, from the console log beside it), with the counters the issues' targets
are about first (ratios, then rates), the row's error when the benchmark skipped it, and a
run's repetitions as their median alone.

Usage: python3 scripts/device_summary.py OUT_DIR   (device-check's log folder)
"""

from __future__ import annotations

import json
import pathlib
import re
import sys

# Not counters: Google Benchmark's own fields.
FIELDS = {"real_time", "cpu_time", "iterations", "repetitions", "repetition_index", "threads",
          "family_index", "per_family_instance_index"}
SHOWN = 5
# Shown whenever a row has them, beyond the first SHOWN: they say whether the row is a
# fair measurement at all (state in pageable memory, a pinned budget capped by the
# locked-memory limit, prefetches refused, more bytes moved than the state).
VALIDITY = ("pageable_MiB", "memlock_capped", "pageable_blocks", "prefetch_skipped", "skipped",
            "B/param")
# Google Benchmark's aggregate rows other than the median: the console fallback leaves
# them out (the JSON path also shows a run's repetitions as their median alone).
AGGREGATES = ("_mean", "_stddev", "_cv")


def rank(name: str) -> int:
    """Order of a counter on the line: what a target judges first (floor_ratio, the
    ratio_vs_* and rel_error rows), then rates, then the rest (alphabetical, as the JSON
    has them, within each)."""
    if "ratio" in name or name == "rel_error":
        return 0
    if "GB" in name or name.endswith("/s"):
        return 1
    return 2


def counters_text(row: dict) -> str:
    counters = [(k, v) for k, v in row.items()
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in FIELDS]
    counters.sort(key=lambda kv: rank(kv[0]))
    shown = counters[:SHOWN]
    shown += [(k, v) for k, v in counters[SHOWN:] if k in VALIDITY]
    return " ".join(f"{k}={v:.4g}" for k, v in shown)


def json_lines(stem: str, rows: list) -> list:
    lines = []
    for row in rows:
        # An error first (review finding: a repeated benchmark's errored repetitions were
        # dropped with its other repetitions, and when too few succeeded for a median the
        # row vanished from the table without a word); each error said once.
        if row.get("error_occurred"):
            line = f"{stem:9s} {row['name'][:60]:60s} SKIPPED: {row.get('error_message')}"
            if line not in lines:
                lines.append(line)
            continue
        if row.get("run_type") == "aggregate" and row.get("aggregate_name") != "median":
            continue
        if row.get("run_type") == "iteration" and row.get("repetitions", 1) > 1:
            continue
        lines.append(f"{stem:9s} {row['name'][:60]:60s} {row.get('real_time', 0):11.4g} "
                     f"{row.get('time_unit', '')} {counters_text(row)}")
    return lines


# A console row: name, time unit, cpu time unit, iterations, then counters (name=value).
CONSOLE_ROW = re.compile(r"^(BM_\S+|\S+/\S+)\s+([\d.e+-]+) (\w+)\s+[\d.e+-]+ \w+\s+\d+(.*)$")


def console_lines(stem: str, text: str) -> list:
    """Rows of a console log whose JSON did not close (the benchmark was killed)."""
    lines = []
    for line in text.splitlines():
        m = CONSOLE_ROW.match(line.strip())
        if m:
            name, time, unit, rest = m.groups()
            if name.endswith(AGGREGATES):
                continue
            lines.append(f"{stem:9s} {name[:60]:60s} {float(time):11.4g} {unit} "
                         f"{' '.join(rest.split())[:80]} (from the console: cut short)")
    return lines


def summary(folder: pathlib.Path) -> list:
    lines = []
    for path in sorted(folder.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (ValueError, OSError):
            console = path.with_suffix(".txt")
            if console.exists():
                lines += console_lines(path.stem, console.read_text(errors="replace"))
            continue
        if isinstance(data, dict) and "benchmarks" in data:
            lines += json_lines(path.stem, data["benchmarks"])
    # Long enough for the counters chosen above; the device tool returns 12,000 characters.
    return [line[:260] for line in lines]


if __name__ == "__main__":
    print("\n".join(summary(pathlib.Path(sys.argv[1]))))
