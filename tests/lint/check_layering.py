#!/usr/bin/env python3
"""Checks the architecture's rules on the source tree (DESIGN.md, "Layers"):

- imports point down only: allocator/ includes nothing from tiering/ or optimizers/,
  tiering/ nothing from optimizers/;
- in allocator/ and tiering/ only the backend files (allocator/backends/) include CUDA
  headers, and nothing there includes LibTorch, cuSOLVER or cuBLAS;
- every source file opens with a summary comment, and none grows past 900 lines.

Exits non-zero and names every violation. Run: check_layering.py REPO_ROOT
"""
import pathlib
import re
import sys

MAX_LINES = 900
SOURCE_SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh", ".c"}
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]')
CUDA_HEADER = re.compile(r"^(cuda|cuda_runtime|cuda_runtime_api|cudaTypedefs|driver_types"
                         r"|cuComplex|cublas|cusolver|nvrtc|curand)")
TORCH_HEADER = re.compile(r"^(torch/|ATen/|c10/|cusolver|cublas)")


def layer_of(path: pathlib.Path, root: pathlib.Path) -> str:
    return path.relative_to(root).parts[0]


def check(root: pathlib.Path) -> list[str]:
    problems = []
    for layer in ("allocator", "tiering", "optimizers", "preload", "examples", "bench", "tests"):
        base = root / layer
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*")):
            if path.suffix not in SOURCE_SUFFIXES or not path.is_file():
                continue
            rel = path.relative_to(root).as_posix()
            text = path.read_text(errors="replace")
            lines = text.splitlines()
            if len(lines) > MAX_LINES:
                problems.append(
                    f"{rel}: {len(lines)} lines (limit {MAX_LINES}): split it by concept")
            first = next((line.strip() for line in lines if line.strip()), "")
            if not (first.startswith("//") or first.startswith("/*")):
                problems.append(f"{rel}: does not open with a summary comment")
            in_backend = rel.startswith("allocator/backends/")
            for number, line in enumerate(lines, 1):
                match = INCLUDE.match(line)
                if not match:
                    continue
                header = match.group(1)
                where = f"{rel}:{number}: includes <{header}>"
                if layer in ("allocator", "tiering"):
                    if CUDA_HEADER.match(header) and not in_backend:
                        problems.append(f"{where}: CUDA headers belong in allocator/backends/ only")
                    if TORCH_HEADER.match(header):
                        problems.append(
                            f"{where}: LibTorch/cuSOLVER/cuBLAS belong in optimizers/ and above")
                if layer == "allocator" and header.startswith(("tiering/", "optimizers/")):
                    problems.append(f"{where}: allocator/ may not import upper layers")
                if layer == "tiering" and header.startswith("optimizers/"):
                    problems.append(f"{where}: tiering/ may not import optimizers/")
    return problems


def main() -> int:
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else ".").resolve()
    problems = check(root)
    for problem in problems:
        print(problem)
    print(f"layering: {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
