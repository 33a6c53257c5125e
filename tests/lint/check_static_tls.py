#!/usr/bin/env python3
"""Fails when a STATIC_TLS shared library's TLS block is larger than a bound.

A library with an initial-exec thread_local is flagged STATIC_TLS: glibc must place its
whole TLS block in the static TLS it keeps spare for dlopen()ed libraries, and dlopen
fails ("cannot allocate memory in static TLS block") when too little is left. tidepool is
dlopen()ed by Python after torch, which leaves about 1400 bytes here, so its block must
stay small: within the 512 bytes glibc reserves for such libraries
(glibc.rtld.optional_static_tls). Note [Static TLS] in allocator/thread_cache.cpp.
Usage: check_static_tls.py MAX_BYTES LIBRARY...
"""

import subprocess
import sys


def readelf(flag: str, library: str) -> str:
    out = subprocess.run(["readelf", flag, "-W", library], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"readelf {flag} {library} failed: {out.stderr.strip()}")
    return out.stdout


def static_tls(library: str) -> bool:
    return any("(FLAGS)" in line and "STATIC_TLS" in line
               for line in readelf("-d", library).splitlines())


def tls_block_bytes(library: str) -> int:
    # Program header row: TLS Offset VirtAddr PhysAddr FileSiz MemSiz Flg Align
    for line in readelf("-l", library).splitlines():
        fields = line.split()
        if fields and fields[0] == "TLS":
            return int(fields[5], 16)
    return 0


def main(args: list[str]) -> int:
    if len(args) < 2 or not args[0].isdigit():
        print("usage: check_static_tls.py MAX_BYTES LIBRARY...", file=sys.stderr)
        return 2
    limit, libraries = int(args[0]), args[1:]
    failed = False
    for lib in libraries:
        size, flagged = tls_block_bytes(lib), static_tls(lib)
        if flagged and size > limit:
            failed = True
            print(f"{lib}: STATIC_TLS with a {size}-byte TLS block (limit {limit}): a dlopen "
                  "after torch may fail with 'cannot allocate memory in static TLS block'. "
                  "Keep large thread_locals on the heap (see Note [Static TLS])", file=sys.stderr)
        else:
            print(f"{lib}: TLS block {size} bytes, {'STATIC_TLS' if flagged else 'dynamic'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
