#!/usr/bin/env python3
"""scripts/soak refuses bad arguments with a clear message and exit status 2, before it
runs anything, and --help prints its usage. (Running a soak itself is not part of the
suite: it reruns the suite's randomized tests seed after seed.)

Usage: check_soak_arguments.py REPO_ROOT
"""
import subprocess
import sys
from pathlib import Path


def run(soak: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(soak), *args], capture_output=True, text=True, timeout=60)


def main() -> int:
    soak = Path(sys.argv[1]) / "scripts" / "soak"
    problems = []
    help_run = run(soak, "--help")
    if help_run.returncode != 0 or "TIDEPOOL_TEST_SEED" not in help_run.stdout:
        problems.append(f"--help: status {help_run.returncode}, output {help_run.stdout!r}")
    refused = {
        ("--seeds", "0"): "positive whole number, not '0'",
        ("--first", "-3"): "positive whole number, not '-3'",
        ("--seeds", "ten"): "positive whole number, not 'ten'",
        ("--scale", "big"): "positive number, not 'big'",
        ("--build", "/nonexistent/build"): "no built test tree in /nonexistent/build",
        ("--frobnicate",): "unknown argument '--frobnicate'",
    }
    for args, message in refused.items():
        result = run(soak, *args)
        if result.returncode != 2 or message not in result.stderr or result.stdout:
            problems.append(f"{' '.join(args)}: status {result.returncode}, "
                            f"stderr {result.stderr!r}, stdout {result.stdout!r}; "
                            f"expected status 2 and {message!r}")
    for p in problems:
        print("scripts/soak:", p)
    print(f"scripts/soak arguments: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
