#!/usr/bin/env python3
"""The README's Python way in, as a user takes it: build the wheel of python/, install it
into a fresh virtual environment, and check in a new interpreter that the package
really works from there (not from the source tree the pytest suite uses):

  - the wheel holds libtidepool, the start-up .pth and the package, tidepool.optim's
    binding (and, in a CUDA build, libtidepool_torch_cuda.so), built against this torch,
    and no library names a build directory in its RUNPATH;
  - without tidepool keys, `import torch` leaves libtidepool unloaded;
  - with them, the .pth hook claims the tidepool keys, leaves PyTorch's own key in the
    variable, loads the installed library and applies tidepool.state_budget, and
    tidepool.optim's Apollo and AADL step from the installed binding;
  - an unknown tidepool key stops `import torch` with a message naming it.

Usage: check_python_wheel.py SOURCE_DIR WORK_DIR   (needs scikit-build-core, torch)
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile


def step(message: str) -> None:
    print(f"[python-wheel] {message}", flush=True)


def run(args: list[str], check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(args, capture_output=True, text=True, **kwargs)
    if check and result.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({result.returncode}):\n"
                         f"{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def check_wheel_contents(wheel: str) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for required in ("tidepool_autoload.pth", "tidepool/__init__.py", "tidepool/_startup.py"):
        if required not in names:
            raise SystemExit(f"{wheel}: {required} is missing (has: {sorted(names)})")
    if not any(n.startswith("tidepool/lib/libtidepool.so") for n in names):
        raise SystemExit(f"{wheel}: no tidepool/lib/libtidepool.so* (has: {sorted(names)})")
    # One file per library: a wheel turns symlinks into copies, so libX.so.0 beside
    # libX.so.0.1.0 would ship X twice (python/CMakeLists.txt names each by its soname).
    libraries = [n for n in names if n.startswith("tidepool/lib/lib") and ".so" in n]
    stems = [n.split(".so")[0] for n in libraries]
    if len(set(stems)) != len(stems):
        raise SystemExit(f"{wheel}: a library is in it more than once: {sorted(libraries)}")
    # Built with torch at hand (this check needs it): tidepool.optim's binding comes along.
    for prefix in ("tidepool/lib/_optim.", "tidepool/lib/libtidepool_optim.so"):
        if not any(n.startswith(prefix) for n in names):
            raise SystemExit(f"{wheel}: a build with torch at hand lacks {prefix}* "
                             f"(has: {sorted(names)})")
    if cuda_build(names) and not any(n.startswith("tidepool/lib/libtidepool_torch_cuda.so")
                                     for n in names):
        raise SystemExit(f"{wheel}: a CUDA build built with torch at hand lacks "
                         f"tidepool/lib/libtidepool_torch_cuda.so (has: {sorted(names)})")


def cuda_build(names: list[str]) -> bool:
    # The LD_PRELOAD shim is built exactly when CUDA is.
    return any(n.startswith("tidepool/lib/libtidepool_preload.so") for n in names)


def check_runpath(site: str, build_dirs: list[str]) -> None:
    lib_dir = os.path.join(site, "tidepool", "lib")
    for name in os.listdir(lib_dir):
        path = os.path.join(lib_dir, name)
        if os.path.islink(path) or ".so" not in name:
            continue
        dynamic = run(["readelf", "-d", "-W", path]).stdout
        for line in dynamic.splitlines():
            if "(RUNPATH)" in line or "(RPATH)" in line:
                if any(d and d in line for d in build_dirs):
                    raise SystemExit(f"{path}: its run path names a build directory: {line}")


PROBE = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.simplefilter("ignore")
    import torch, tidepool, tidepool._lib as lib
    report = {"loaded": lib._lib is not None,
              "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}
    if report["loaded"]:
        report["library"] = lib.library_path()
        report["budget"] = tidepool.stats().get("tiering.vmm_device_budget_bytes")
        report["torch_cuda"] = lib.torch_cuda_library_path()
        report["torch_cuda_loads"] = lib.load_torch_cuda()[1] or "yes"
        import tidepool.optim
        device = "cuda" if torch.cuda.is_available() else "cpu"  # tidepool's backend's
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.float64, device=device))
        opt = tidepool.optim.AADL(torch.optim.SGD([p], lr=0.1), history_depth=3)
        apollo = tidepool.optim.Apollo([p], lr=0.1, state="tiered")
        for o in (opt, apollo):
            o.zero_grad(); (p * p).sum().backward(); o.step()
        report["optim"] = "stepped" if bool((p < 1).all()) else f"unchanged: {p.tolist()}"
    print(json.dumps(report))
""")


def probe(python: str, cwd: str, conf: str | None) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "TIDEPOOL_LIBRARY", "TIDEPOOL_TORCH_CUDA_LIBRARY",
                        "TIDEPOOL_OPTIM_MODULE", "PYTORCH_CUDA_ALLOC_CONF",
                        "PYTORCH_ALLOC_CONF")}
    if conf is not None:
        env["PYTORCH_CUDA_ALLOC_CONF"] = conf
    out = run([python, "-c", PROBE], cwd=cwd, env=env).stdout.strip().splitlines()
    return json.loads(out[-1])


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    source, work = (os.path.abspath(a) for a in argv)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    wheel_dir, venv = os.path.join(work, "wheel"), os.path.join(work, "venv")

    step("building the wheel of python/ (pip wheel, scikit-build-core)")
    run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps",
         "--disable-pip-version-check", "-q", "-w", wheel_dir, os.path.join(source, "python")])
    wheels = [os.path.join(wheel_dir, w) for w in os.listdir(wheel_dir) if w.endswith(".whl")]
    if len(wheels) != 1:
        raise SystemExit(f"expected one wheel in {wheel_dir}, found {wheels}")
    check_wheel_contents(wheels[0])

    step("installing it into a fresh virtual environment (torch from the system site)")
    run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", venv])
    python = os.path.join(venv, "bin", "python")
    run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "-q",
         "--disable-pip-version-check", wheels[0]])
    site = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['platlib'])"]
               ).stdout.strip()
    check_runpath(site, [source, work])

    step("import torch without tidepool keys")
    plain = probe(python, work, None)
    if plain["loaded"]:
        raise SystemExit(f"libtidepool was loaded although no tidepool key was set: {plain}")

    step("import torch with backend:tidepool and tidepool.state_budget:1GiB")
    claimed = probe(python, work,
                    "max_split_size_mb:256,backend:tidepool,tidepool.state_budget:1GiB")
    if not claimed["loaded"]:
        raise SystemExit(f"the .pth hook did not load libtidepool: {claimed}")
    if claimed["conf"] != "max_split_size_mb:256":
        raise SystemExit(f"PyTorch's variable should keep only its own key: {claimed}")
    if not claimed["library"].startswith(os.path.join(site, "tidepool", "lib")):
        raise SystemExit(f"the library loaded is not the installed one: {claimed}")
    if claimed["optim"] != "stepped":
        raise SystemExit(f"tidepool.optim does not work from the installed wheel: {claimed}")
    if claimed["budget"] != 1 << 30:
        raise SystemExit(f"tidepool.state_budget:1GiB was not applied: {claimed}")
    if cuda_build(zipfile.ZipFile(wheels[0]).namelist()):
        if not (claimed["torch_cuda"] or "").startswith(os.path.join(site, "tidepool", "lib")):
            raise SystemExit(f"the installed libtidepool_torch_cuda.so is not found: {claimed}")
        if claimed["torch_cuda_loads"] != "yes":
            raise SystemExit(
                f"libtidepool_torch_cuda.so does not load against this torch: {claimed}")

    step("import torch with an unknown tidepool key")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TIDEPOOL_LIBRARY")}
    env["PYTORCH_CUDA_ALLOC_CONF"] = "backend:tidepool,tidepool.bogus:1"
    bad = run([python, "-c", "import torch"], check=False, cwd=work, env=env)
    if bad.returncode == 0 or "unknown key 'tidepool.bogus'" not in bad.stderr:
        raise SystemExit(f"an unknown key must stop import torch naming it; got status "
                         f"{bad.returncode}, stderr:\n{bad.stderr[-2000:]}")

    step("the installed wheel works")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
