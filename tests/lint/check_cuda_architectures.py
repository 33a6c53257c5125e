#!/usr/bin/env python3
"""Checks that a library's CUDA kernels were compiled for every architecture the build
chose (TORCH_CUDA_ARCH_LIST, which Torch's CMake compiles the project's CUDA files for:
cmake/TidepoolOptions.cmake). Left at Torch's one architecture, the fused kernels had an
image for one card alone and failed with "no kernel image is available" on any other.

Each cubin nvcc embeds carries its ptxas options ("-arch sm_90 -m 64") uncompressed in
the fat binary; those are what this reads, so it needs no cuobjdump.

Usage: check_cuda_architectures.py LIBRARY "7.5;8.0;9.0;12.0+PTX"
"""

from __future__ import annotations

import re
import sys


def expected_sms(torch_arch_list: str) -> set[str]:
    """sm_XY[a|f] of each X.Y[a|f] (with or without +PTX) in a TORCH_CUDA_ARCH_LIST."""
    sms = set()
    for entry in re.split(r"[;\s]+", torch_arch_list.strip()):
        m = re.fullmatch(r"(\d+)\.(\d)([af]?)(\+PTX)?", entry)
        if m:
            sms.add(f"sm_{m.group(1)}{m.group(2)}{m.group(3)}")
    return sms


def embedded_sms(data: bytes) -> set[str]:
    return {m.decode() for m in re.findall(rb"-arch (sm_\d+[af]?) ", data)}


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    library, arch_list = argv[1], argv[2]
    want = expected_sms(arch_list)
    if not want:
        print(f"no architecture in {arch_list!r}", file=sys.stderr)
        return 2
    with open(library, "rb") as f:
        have = embedded_sms(f.read())
    missing = sorted(want - have)
    if missing:
        print(f"{library}: no kernel image for {', '.join(missing)} (it has "
              f"{', '.join(sorted(have)) or 'none'}; the build chose {arch_list})")
        return 1
    print(f"{library}: kernel images for {', '.join(sorted(have))}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
