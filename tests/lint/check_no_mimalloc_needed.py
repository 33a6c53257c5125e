#!/usr/bin/env python3
"""Fails when a shared library has a DT_NEEDED entry for mimalloc.

Debian's libmimalloc.so.2 overrides malloc/free/operator new/delete; as a dependency of
libtidepool.so it would give every process that loads tidepool a second allocator (see
Note [mimalloc is loaded RTLD_LOCAL] in tiering/host_arena.cpp). tidepool dlopen()s it
RTLD_LOCAL instead. Usage: check_no_mimalloc_needed.py LIBRARY...
"""

import subprocess
import sys


def needed_entries(library: str) -> list[str]:
    out = subprocess.run(["readelf", "-d", "-W", library], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"readelf -d {library} failed: {out.stderr.strip()}")
    return [line.split("[", 1)[1].rstrip("]") for line in out.stdout.splitlines()
            if "(NEEDED)" in line and "[" in line]


def main(libraries: list[str]) -> int:
    if not libraries:
        print("usage: check_no_mimalloc_needed.py LIBRARY...", file=sys.stderr)
        return 2
    bad = [(lib, n) for lib in libraries for n in needed_entries(lib) if "mimalloc" in n]
    for lib, n in bad:
        print(f"{lib}: NEEDED {n}: tidepool must not link mimalloc (it replaces malloc for the "
              "process); dlopen it RTLD_LOCAL as tiering/host_arena.cpp does", file=sys.stderr)
    if not bad:
        print("no mimalloc NEEDED entry in: " + ", ".join(libraries))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
