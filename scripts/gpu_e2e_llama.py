#!/usr/bin/env python3
"""End-to-end check of the drop-in path on a GPU machine (issue 6): a Llama-style
transformers model with random weights (no downloads) trained with stock
torch.optim.AdamW, once plainly and once with PYTORCH_CUDA_ALLOC_CONF=backend:tidepool.

Checks, each in a fresh process (the allocator is chosen at process start):
  plain       the reference: losses, peak device memory, step time;
  tidepool    the same training through the .pth hook: bitwise the same losses, peak
              device memory lower by >= 90% of the optimizer-state bytes (the whole
              run's peak, first step included), step-time overhead against the floor of moving
              that state across the link (in and out, 93.2 GB/s measured both ways at
              once on the H200, DESIGN.md);
  cap_plain / cap_tidepool
              a memory cap (torch.cuda.set_per_process_memory_fraction, plus a ballast
              allocation so the cap is physical for every way in) between the two
              peaks: the plain run must hit OutOfMemoryError, the tidepool run must train;
  preload     LD_PRELOAD=libtidepool_preload.so: the same losses, and tidepool served
              the device memory.
Prints one JSON summary and exits 1 if any check fails, 2 when it cannot run (no CUDA,
no transformers, tidepool not installed).

Usage: python scripts/gpu_e2e_llama.py [--steps 6] [--layers 22] [--out results.json]
       python scripts/gpu_e2e_llama.py --worker plain --tiny --device cpu   (self-test)
The package must be installed (`pip install --no-build-isolation ./python`), or, from a
build tree (scripts/device-check's):
  cmake -S . -B build-gpu -DTIDEPOOL_BUILD_TESTS=OFF -DTIDEPOOL_BUILD_BENCH=OFF \
        -DTIDEPOOL_BUILD_EXAMPLES=OFF
  cmake --build build-gpu -j16 --target tidepool tidepool_preload tidepool_torch_cuda
  TIDEPOOL_LIBRARY=build-gpu/allocator/libtidepool.so \
  TIDEPOOL_TORCH_CUDA_LIBRARY=build-gpu/optimizers/install/libtidepool_torch_cuda.so \
  TIDEPOOL_PRELOAD_LIBRARY=build-gpu/preload/libtidepool_preload.so \
  PYTHONPATH=python/src python scripts/gpu_e2e_llama.py --out e2e.json
(the workers then run the .pth hook's import themselves). transformers must be
installed beforehand: the device machine reaches no package index.

Status: written without a GPU at hand; the CPU self-test (--tiny --device cpu) runs the
training loop, the determinism settings and the JSON plumbing, nothing CUDA-specific.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

LINK_GBPS_BOTH_WAYS = 93.2e9  # pinned H2D + D2H at once, H200 (DESIGN.md)
EXIT_CANNOT_RUN = 2


# ---- worker: one training run in this process -----------------------------------------

def llama_config(args):
    from transformers import LlamaConfig
    if args.tiny:
        return LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=args.seq, attn_implementation="eager")
    # TinyLlama-1.1B's shape (22 layers); --layers scales it.
    return LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                       num_hidden_layers=args.layers, num_attention_heads=32,
                       num_key_value_heads=4, max_position_embeddings=args.seq,
                       attn_implementation="eager")


class PeakSampler:
    """Samples device memory in use (total - free, the whole device as NVML sees it)
    every ~0.5 ms on a thread, so the peak covers every allocator, tidepool's VMM ranges
    included. `phase` lets the caller split the peak into first step vs steady state."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device
        self.phase = "setup"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        torch = self.torch
        torch.cuda.set_device(self.device)
        while not self._stop.is_set():
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            if used > self.peaks.get(self.phase, 0):
                self.peaks[self.phase] = used
            time.sleep(0.0005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def cap_device_memory(torch, cap_bytes: int) -> int:
    """Leaves `cap_bytes` of device memory (counted as the sampler counts: everything in
    use on the device) to this process. set_per_process_memory_fraction binds PyTorch's
    native allocator and, in global mode, tidepool (tidepool_set_memory_fraction); a
    ballast taken straight from libcudart (past any allocator, and past the LD_PRELOAD
    shim) makes the cap physical too, so every run meets the same device."""
    import ctypes
    free, total = torch.cuda.mem_get_info()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total))
    ballast_bytes = max(0, total - cap_bytes)
    cudart = ctypes.CDLL("libcudart.so.13")
    ptr = ctypes.c_void_p()
    rc = cudart.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(ballast_bytes))
    if rc != 0:
        raise RuntimeError(f"ballast cudaMalloc of {ballast_bytes} bytes failed: error {rc}")
    return ballast_bytes


def worker(args) -> dict:
    if args.worker in ("tidepool", "cap_tidepool"):
        # What tidepool_autoload.pth does in an installed package; a no-op after it ran.
        try:
            import tidepool._autoload  # noqa: F401
        except ImportError as e:
            return {"cannot_run": f"the tidepool package is not importable ({e}); "
                                  "pip install --no-build-isolation ./python, "
                                  "or set PYTHONPATH=python/src"}
    import torch
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        return {"cannot_run": "transformers is not installed (pip install transformers)"}
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        return {"cannot_run": "no CUDA device"}
    result: dict = {"mode": args.worker}
    if args.worker in ("tidepool", "cap_tidepool"):
        import tidepool
        result["tidepool_status"] = tidepool.status()
        if not tidepool.status().startswith("active"):
            return {"cannot_run": f"tidepool is not active: {tidepool.status()}"}

    # Deterministic settings: the same kernels in every run, so losses match bitwise.
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device)

    if args.worker.startswith("cap_"):
        result["cap_bytes"] = args.cap_bytes
        result["ballast_bytes"] = cap_device_memory(torch, args.cap_bytes)

    with torch.device(device):
        model = LlamaForCausalLM(llama_config(args))
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    generator = torch.Generator(device=device).manual_seed(1)
    batches = [torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device=device,
                             generator=generator) for _ in range(args.steps)]
    result.update(params=n_params, state_bytes=2 * 4 * n_params)  # AdamW: exp_avg, exp_avg_sq fp32

    losses, step_seconds = [], []
    sampler = PeakSampler(torch, device.index or 0) if cuda else None
    try:
        if sampler:
            sampler.__enter__()
        for i, ids in enumerate(batches):
            if sampler:
                sampler.phase = "first_step" if i == 0 else "steady"
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())  # synchronises
            step_seconds.append(time.perf_counter() - start)
    except torch.OutOfMemoryError as e:
        result["oom"] = str(e).splitlines()[0]
        result["losses"] = losses
        return result
    finally:
        if sampler:
            sampler.__exit__(None, None, None)
    result["losses"] = [float.hex(x) for x in losses]  # exact, for bitwise comparison
    result["losses_readable"] = losses
    result["step_seconds"] = step_seconds
    result["steady_step_seconds"] = (statistics.median(step_seconds[1:])
                                     if len(step_seconds) > 1 else None)
    if sampler:
        result["peak_device_bytes"] = sampler.peaks
        result["torch_max_reserved"] = _safe(torch.cuda.max_memory_reserved)
    if args.worker in ("tidepool", "cap_tidepool", "preload"):
        import tidepool
        stats = tidepool.stats(0)
        result["tidepool_stats"] = {k: v for k, v in stats.items()
                                    if k.startswith(("allocated_bytes.all", "reserved_bytes.all",
                                                     "tag.optimizer_state", "transfer.",
                                                     "tiering.vmm"))}
    return result


def _safe(fn):
    try:
        return fn()
    except Exception as e:  # the pluggable allocator does not keep torch's stats
        return f"n/a ({type(e).__name__})"


# ---- driver: run the workers, compare ---------------------------------------------------

def run_worker(name: str, args, env_extra: dict, extra_args=()) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "TIDEPOOL_ALLOC_CONF",
                        "LD_PRELOAD")}
    env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # deterministic cuBLAS
    env.update(env_extra)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, "--steps", str(args.steps),
           "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq),
           "--device", args.device, *extra_args]
    if args.tiny:
        cmd.append("--tiny")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        out = {"mode": name, "failed": f"timed out after {e.timeout} s",
               "stderr_tail": (tail or "")[-3000:]}
    else:
        lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        out = json.loads(lines[-1]) if lines else {"mode": name}
        if proc.returncode != 0 and "cannot_run" not in out:
            out["failed"] = f"exit {proc.returncode}"
        out["stderr_tail"] = proc.stderr[-3000:]
    # One line per run as it ends: a driver cut short by its caller still reports these.
    brief = {k: out.get(k) for k in ("cannot_run", "failed", "oom", "params", "losses_readable",
                                     "steady_step_seconds", "peak_device_bytes") if k in out}
    if "failed" in out or "cannot_run" in out:
        brief["stderr_tail"] = out["stderr_tail"][-600:]
    print(f"[e2e {time.perf_counter() - start:5.1f}s] {name}: {json.dumps(brief)}", flush=True)
    return out


def find_preload() -> str | None:
    path = os.environ.get("TIDEPOOL_PRELOAD_LIBRARY")
    if path:
        return path
    try:
        import tidepool
    except ImportError:
        return None
    candidate = os.path.join(os.path.dirname(tidepool.__file__), "lib", "libtidepool_preload.so")
    return candidate if os.path.isfile(candidate) else None


def driver(args) -> int:
    summary: dict = {"checks": {}, "runs": {}}
    checks = summary["checks"]

    def check(name, ok, detail):
        checks[name] = {"ok": bool(ok), "detail": detail}

    plain = run_worker("plain", args, {})
    summary["runs"]["plain"] = plain
    if "cannot_run" in plain or "failed" in plain:
        print(json.dumps(summary, indent=1))
        return EXIT_CANNOT_RUN
    tp = run_worker("tidepool", args, {"PYTORCH_CUDA_ALLOC_CONF": "backend:tidepool"})
    summary["runs"]["tidepool"] = tp
    if "cannot_run" in tp:
        print(json.dumps(summary, indent=1))
        return EXIT_CANNOT_RUN

    check("tidepool_run_completed", "losses" in tp and "oom" not in tp,
          tp.get("failed") or tp.get("oom"))
    check("same_losses_bitwise", tp.get("losses") == plain["losses"],
          {"plain": plain.get("losses_readable"), "tidepool": tp.get("losses_readable")})
    state = plain["state_bytes"]
    if args.device == "cuda" and "peak_device_bytes" in tp:
        # The whole run's peak, first step included: the step that creates the state
        # counts as much as the others (on 2026-12-04 only the steady peak was compared,
        # and tidepool's first step peaked above all of the plain run).
        p_peak = max(plain["peak_device_bytes"].values(), default=0)
        t_peak = max(tp["peak_device_bytes"].values(), default=0)
        saved = p_peak - t_peak
        check("peak_lower_by_90pct_of_state", saved >= 0.9 * state,
              {"plain_peak": p_peak, "tidepool_peak": t_peak, "saved": saved,
               "state_bytes": state, "saved_fraction_of_state": saved / state,
               "first_step_peaks": [plain["peak_device_bytes"].get("first_step"),
                                    tp["peak_device_bytes"].get("first_step")],
               "steady_peaks": [plain["peak_device_bytes"].get("steady"),
                                tp["peak_device_bytes"].get("steady")]})
        floor = 2 * state / LINK_GBPS_BOTH_WAYS
        overhead = (tp["steady_step_seconds"] or 0) - (plain["steady_step_seconds"] or 0)
        summary["step_time"] = {"plain_s": plain["steady_step_seconds"],
                                "tidepool_s": tp["steady_step_seconds"], "overhead_s": overhead,
                                "link_floor_s": floor, "overhead_over_floor": overhead / floor}

        # Memory cap between the two peaks: plain cannot train, tidepool can.
        cap_args = ("--cap-bytes", str((p_peak + t_peak) // 2))
        cap_plain = run_worker("cap_plain", args, {}, cap_args)
        cap_tp = run_worker("cap_tidepool", args, {"PYTORCH_CUDA_ALLOC_CONF": "backend:tidepool"},
                            cap_args)
        summary["runs"].update(cap_plain=cap_plain, cap_tidepool=cap_tp)
        check("cap_plain_runs_out_of_memory", "oom" in cap_plain,
              cap_plain.get("oom") or cap_plain.get("failed"))
        check("cap_tidepool_trains",
              "oom" not in cap_tp and cap_tp.get("losses") == plain["losses"],
              cap_tp.get("oom") or cap_tp.get("failed") or cap_tp.get("losses_readable"))

    preload = find_preload()
    if preload is None:
        check("preload_run", False,
              "libtidepool_preload.so not found (set TIDEPOOL_PRELOAD_LIBRARY)")
    else:
        pre = run_worker("preload", args, {"LD_PRELOAD": preload,
                                           "PYTORCH_CUDA_ALLOC_CONF": "tidepool.log:info"})
        summary["runs"]["preload"] = pre
        served = (pre.get("tidepool_stats") or {}).get("allocated_bytes.all.peak", 0)
        check("preload_same_losses", pre.get("losses") == plain["losses"],
              pre.get("failed") or pre.get("losses_readable"))
        check("preload_served_by_tidepool", served > 0, {"tidepool_allocated_peak": served})

    failed = [name for name, c in checks.items() if not c["ok"]]
    summary["result"] = "PASS" if not failed else f"FAIL: {', '.join(failed)}"
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    return 0 if not failed else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker",
                        choices=["plain", "tidepool", "cap_plain", "cap_tidepool", "preload"])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--tiny", action="store_true", help="a 2-layer toy model (self-test)")
    parser.add_argument("--cap-bytes", type=int, default=0)
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps must be at least 2 (the first step is warm-up)")
    if args.worker:
        result = worker(args)
        print(json.dumps(result))
        return EXIT_CANNOT_RUN if "cannot_run" in result else 0
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
