#!/usr/bin/env python3
"""Checks that no line of the project's code is longer than 100 characters (STYLE: a
line reads whole in a side-by-side diff and a terminal split in two).

Code is every C/C++/CUDA source, Python file, CMake file, and the scripts under
scripts/ and .ci/ (files without a suffix there are shell or Python). Characters, not
bytes: a comment's math symbols count one each. Markdown is left out (a table row has
to stay on one line), and so are the build trees and caches git ignores.

Exits non-zero and names every line over the limit. Run: check_line_length.py REPO_ROOT
"""
import pathlib
import sys

LIMIT = 100
CODE_SUFFIXES = {".h", ".hpp", ".cpp", ".cc", ".cu", ".cuh", ".c", ".py", ".cmake", ".in",
                 ".toml", ".pth", ".sh"}
SCRIPT_DIRS = {"scripts", ".ci"}
SKIPPED_DIRS = {".git", "_skbuild", "__pycache__", ".pytest_cache", "dist"}


def is_skipped_dir(name: str) -> bool:
    return name in SKIPPED_DIRS or name.startswith("build") or name.endswith(".egg-info")


def is_code(path: pathlib.Path, root: pathlib.Path) -> bool:
    if path.name == "CMakeLists.txt" or path.suffix in CODE_SUFFIXES:
        return True
    return path.relative_to(root).parts[0] in SCRIPT_DIRS and path.suffix == ""


def code_files(root: pathlib.Path):
    stack = [root]
    while stack:
        folder = stack.pop()
        for entry in sorted(folder.iterdir()):
            if entry.is_dir() and not entry.is_symlink():
                if not is_skipped_dir(entry.name):
                    stack.append(entry)
            elif entry.is_file() and is_code(entry, root):
                yield entry


def check(root: pathlib.Path) -> list[str]:
    problems = []
    for path in code_files(root):
        rel = path.relative_to(root).as_posix()
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            problems.append(f"{rel}: not UTF-8 ({e})")
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if len(line) > LIMIT:
                problems.append(f"{rel}:{number}: {len(line)} characters (limit {LIMIT})")
    return problems


def main() -> int:
    if len(sys.argv) != 2 or not pathlib.Path(sys.argv[1]).is_dir():
        print("usage: check_line_length.py REPO_ROOT", file=sys.stderr)
        return 2
    problems = check(pathlib.Path(sys.argv[1]).resolve())
    for problem in problems:
        print(problem)
    if problems:
        print(f"{len(problems)} line(s) over {LIMIT} characters: wrap them", file=sys.stderr)
        return 1
    print(f"every line of code is at most {LIMIT} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
