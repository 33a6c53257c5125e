#!/usr/bin/env python3
"""End-to-end check of the drop-in path on a GPU machine (issue 6): a Llama-style
transformers model with random weights (no downloads) trained with stock
torch.optim.AdamW, once plainly and once with PYTORCH_CUDA_ALLOC_CONF=backend:tidepool.

Checks, each in a fresh process (the allocator is chosen at process start):
  plain       the reference: losses, peak device memory, step time;
  tidepool    the same training through the .pth hook: bitwise the same losses, peak
              device memory lower by >= 90% of the optimizer-state bytes (the whole
              run's peak, first step included); reported, not checked: the step-time
              overhead against the floor of moving that state out and back in at the
              pinned rate with both directions busy, which the plain run measures after
              its steps (measure_link);
  cap_plain / cap_tidepool
              a memory cap (torch.cuda.set_per_process_memory_fraction, plus a ballast
              allocation so the cap is physical for every way in) between the two
              peaks: the plain run must hit OutOfMemoryError, the tidepool run must train;
  preload     LD_PRELOAD=libtidepool_preload.so: the same losses, and tidepool served
              the device memory.
Prints one line per run as it ends ("[e2e ...]"), the measured link rates and the step
time against its floor, then one JSON summary (also written to --out) with "result", and
exits 1 if any check fails, 2 when it cannot run (no CUDA, no transformers, tidepool not
installed), 3 when every check that ran passed and some had no time left to run.
--timeout bounds the whole run: each run gets what is left of it.

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

Status: ran on the H200 on 2026-12-04 (bench/RESULTS.md), when the floor used a link rate
from DESIGN.md; measure_link, which replaced it, has not run on a GPU yet. The CPU
self-test (--tiny --device cpu) runs the training loop, the determinism settings and the
JSON plumbing, nothing CUDA-specific; tests/python/test_device_checks.py runs the
driver's verdicts on canned runs.
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

EXIT_CANNOT_RUN = 2
EXIT_NOT_RUN = 3  # every check that ran passed; some had no time left to run
# The link probe: big enough that a copy takes milliseconds (launch costs vanish), small
# enough that pinning it takes a fraction of a second.
LINK_PROBE_BYTES = 256 << 20
LINK_PROBE_REPEATS = 5
# Of the driver's --timeout: what the summary keeps back, and the least a run is started with.
SUMMARY_SECONDS = 3
MIN_RUN_SECONDS = 10


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


def measure_link(torch, nbytes: int = LINK_PROBE_BYTES, repeats: int = LINK_PROBE_REPEATS):
    """The pinned host<->device copy rates of this machine, in GB/s (1e9 bytes/s): H2D
    alone, D2H alone, and both at once on two streams (bytes moved both ways over the
    time until both are done). Best of `repeats` after one untimed pass each, timed with
    CUDA events on the current stream, which each copy stream waits for and which waits
    for them: the device's time from the first copy's start to the last one's end,
    without the host's set-up (pinning, allocation) or its synchronisation."""
    pinned = {"dtype": torch.uint8, "pin_memory": True}
    host_up, host_down = torch.empty(nbytes, **pinned), torch.empty(nbytes, **pinned)
    dev_up = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev_down = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    main = torch.cuda.current_stream()
    up, down = torch.cuda.Stream(), torch.cuda.Stream()
    h2d, d2h = (up, dev_up, host_up), (down, host_down, dev_down)

    def seconds(copies) -> float:
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        # Keeps the device busy while the host issues what follows, so that `start` is
        # passed when the copies are already queued: the host's issuing is not timed.
        torch.cuda._sleep(1 << 20)
        start.record(main)
        # Main waits for the copy streams only once all copies are issued: a stream made
        # to wait for main after that would wait for the other direction's copy too.
        for stream, _, _ in copies:
            stream.wait_stream(main)
        for stream, dst, src in copies:
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        for stream, _, _ in copies:
            main.wait_stream(stream)
        end.record(main)
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    rates = {"probe_bytes": nbytes, "repeats": repeats}
    for name, copies in (("h2d", [h2d]), ("d2h", [d2h]), ("both_ways", [h2d, d2h])):
        seconds(copies)  # first use of the streams and of the copy paths
        best = min(seconds(copies) for _ in range(repeats))
        rates[f"{name}_gbps"] = len(copies) * nbytes / best / 1e9 if best > 0 else None
    torch.cuda.synchronize()
    return rates


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

    try:
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(args))
        model.train()
        n_params = sum(p.numel() for p in model.parameters())
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        generator = torch.Generator(device=device).manual_seed(1)
        batches = [torch.randint(0, model.config.vocab_size, (args.batch, args.seq),
                                 device=device, generator=generator) for _ in range(args.steps)]
    except torch.OutOfMemoryError as e:  # under a cap: out of memory before any step
        result.update(oom=f"before the first step: {first_line(e)}", losses=[])
        return result
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
            losses.append(loss.item())
            if cuda:  # the whole device: tidepool's moves run on streams of their own
                torch.cuda.synchronize()
            step_seconds.append(time.perf_counter() - start)
    except torch.OutOfMemoryError as e:
        result["oom"] = first_line(e)
        result["losses"] = losses
        return result
    finally:
        if sampler:
            sampler.__exit__(None, None, None)
    if cuda and args.worker == "plain":
        # The floor the driver sets the step-time overhead against: measured here, after
        # the steps and outside the peak sampler, so that it is this machine's in this run.
        try:
            result["link"] = measure_link(torch)
        except Exception as e:  # the checks stand without it; the floor is then not given
            result["link"] = {"error": f"{type(e).__name__}: {first_line(e)}"}
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


def first_line(error: BaseException) -> str:
    lines = str(error).splitlines()
    return lines[0] if lines else type(error).__name__


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
    # --timeout is the whole driver's: a run that hangs must leave time for the summary.
    left = args.deadline - time.monotonic() - SUMMARY_SECONDS
    if left < MIN_RUN_SECONDS:
        out = {"mode": name, "failed": f"not run: {max(0.0, left):.0f} s of --timeout left",
               "stderr_tail": ""}
    else:
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
        except subprocess.TimeoutExpired as e:
            tail = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
            out = {"mode": name, "failed": f"timed out after {e.timeout:.0f} s",
                   "stderr_tail": (tail or "")[-3000:]}
        else:
            out = last_json_object(proc.stdout) or {"mode": name}
            if proc.returncode != 0 and "cannot_run" not in out:
                out["failed"] = f"exit {proc.returncode}"
            out["stderr_tail"] = proc.stderr[-3000:]
    # One line per run as it ends: a driver cut short by its caller still reports these.
    brief = {k: out.get(k) for k in ("cannot_run", "failed", "oom", "params", "losses_readable",
                                     "steady_step_seconds", "peak_device_bytes", "link")
             if k in out}
    if "failed" in out or "cannot_run" in out:
        brief["stderr_tail"] = out["stderr_tail"][-600:]
    print(f"[e2e {time.perf_counter() - start:5.1f}s] {name}: {json.dumps(brief)}", flush=True)
    return out


def last_json_object(text: str) -> dict | None:
    """The worker's result: its last stdout line that is a JSON object (a library may
    print other lines, even ones starting with a brace)."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


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


def step_time(plain: dict, tp: dict, state: int) -> dict:
    """The steady step times, tidepool's overhead, and the floor of that overhead: the
    state moved out and back in at the pinned rate with both directions busy, as the
    plain run measured it in this run (no floor when it could not)."""
    plain_s, tp_s = plain.get("steady_step_seconds"), tp.get("steady_step_seconds")
    overhead = tp_s - plain_s if plain_s is not None and tp_s is not None else None
    link = plain.get("link") or {}
    both = link.get("both_ways_gbps")
    floor = 2 * state / (both * 1e9) if both else None
    return {"plain_s": plain_s, "tidepool_s": tp_s, "overhead_s": overhead,
            "link": link, "link_floor_s": floor,
            "overhead_over_floor": overhead / floor if overhead is not None and floor else None}


def describe_step_time(t: dict, state: int) -> list[str]:
    """The lines device-check shows ("[e2e]" first): the link rates and the overhead
    against the floor, each figure from this run."""
    link = t["link"]
    if link.get("both_ways_gbps"):
        named = (("H2D", "h2d_gbps"), ("D2H", "d2h_gbps"), ("both at once", "both_ways_gbps"))
        rates = [f"{name} {link[key]:.1f} GB/s" for name, key in named if link.get(key)]
        lines = [f"[e2e] link, pinned, measured in this run ({link.get('probe_bytes', 0) >> 20} "
                 f"MiB, best of {link.get('repeats')}): {', '.join(rates)}"]
    else:
        lines = [f"[e2e] link: not measured ({link.get('error', 'no figure from the plain run')})"
                 "; no floor for the step time"]
    if t["overhead_s"] is None:
        return lines + ["[e2e] step time: no steady step time from both runs"]
    line = (f"[e2e] step time: plain {t['plain_s']:.3f} s, tidepool {t['tidepool_s']:.3f} s, "
            f"overhead {t['overhead_s']:.3f} s")
    if t["link_floor_s"]:
        line += (f"; floor of moving the state out and in (2 x {state / 1e9:.2f} GB at "
                 f"{link['both_ways_gbps']:.1f} GB/s) {t['link_floor_s']:.3f} s: "
                 f"{t['overhead_over_floor']:.2f}x")
    return lines + [line]


def driver(args) -> int:
    args.deadline = time.monotonic() + args.timeout
    summary: dict = {"checks": {}, "runs": {}}
    checks = summary["checks"]

    def check(name, ok, detail, runs=()):
        # A check whose run had no time left (run_worker: "not run: ...") is not run, not
        # failed: time ran out, which says nothing of the product.
        skipped = [r["failed"] for r in runs if str(r.get("failed", "")).startswith("not run")]
        if skipped:
            checks[name] = {"ok": None, "detail": skipped[0]}
        else:
            checks[name] = {"ok": bool(ok), "detail": detail}

    def finish(code: int) -> int:
        text = json.dumps(summary, indent=1)
        print(text)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text)
        if checks:
            failed = sum(c["ok"] is False for c in checks.values())
            not_run = sum(c["ok"] is None for c in checks.values())
            print(f"{len(checks) - failed - not_run} passed, {failed} failed"
                  + (f", {not_run} not run (no time left)" if not_run else ""))
        return code

    plain = run_worker("plain", args, {})
    summary["runs"]["plain"] = plain
    if "cannot_run" in plain or "failed" in plain or "oom" in plain:
        summary["result"] = ("CANNOT RUN: the plain run: "
                             + str(plain.get("cannot_run") or plain.get("failed")
                                   or plain.get("oom")))
        return finish(EXIT_CANNOT_RUN)
    tp = run_worker("tidepool", args, {"PYTORCH_CUDA_ALLOC_CONF": "backend:tidepool"})
    summary["runs"]["tidepool"] = tp
    if "cannot_run" in tp:
        summary["result"] = f"CANNOT RUN: the tidepool run: {tp['cannot_run']}"
        return finish(EXIT_CANNOT_RUN)

    # A run that printed its results and then crashed (at exit, say) did not complete.
    check("tidepool_run_completed", "losses" in tp and "oom" not in tp and "failed" not in tp,
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
        summary["step_time"] = step_time(plain, tp, state)
        for line in describe_step_time(summary["step_time"], state):
            print(line, flush=True)

        # Memory cap between the two peaks: plain cannot train, tidepool can.
        cap_args = ("--cap-bytes", str((p_peak + t_peak) // 2))
        cap_plain = run_worker("cap_plain", args, {}, cap_args)
        cap_tp = run_worker("cap_tidepool", args, {"PYTORCH_CUDA_ALLOC_CONF": "backend:tidepool"},
                            cap_args)
        summary["runs"].update(cap_plain=cap_plain, cap_tidepool=cap_tp)
        check("cap_plain_runs_out_of_memory", "oom" in cap_plain,
              cap_plain.get("oom") or cap_plain.get("failed"), (cap_plain,))
        check("cap_tidepool_trains",
              "oom" not in cap_tp and "failed" not in cap_tp
              and cap_tp.get("losses") == plain["losses"],
              cap_tp.get("oom") or cap_tp.get("failed") or cap_tp.get("losses_readable"),
              (cap_tp,))

    preload = find_preload()
    if preload is None:
        check("preload_run", False,
              "libtidepool_preload.so not found (set TIDEPOOL_PRELOAD_LIBRARY)")
    else:
        pre = run_worker("preload", args, {"LD_PRELOAD": preload,
                                           "PYTORCH_CUDA_ALLOC_CONF": "tidepool.log:info"})
        summary["runs"]["preload"] = pre
        served = (pre.get("tidepool_stats") or {}).get("allocated_bytes.all.peak", 0)
        check("preload_same_losses", "failed" not in pre and pre.get("losses") == plain["losses"],
              pre.get("failed") or pre.get("losses_readable"), (pre,))
        check("preload_served_by_tidepool", served > 0, {"tidepool_allocated_peak": served},
              (pre,))

    failed = [name for name, c in checks.items() if c["ok"] is False]
    not_run = [name for name, c in checks.items() if c["ok"] is None]
    if failed:
        summary["result"] = f"FAIL: {', '.join(failed)}"
    elif not_run:
        summary["result"] = f"NOT RUN (no time left): {', '.join(not_run)}"
    else:
        summary["result"] = "PASS"
    return finish(1 if failed else EXIT_NOT_RUN if not_run else 0)


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
    parser.add_argument("--timeout", type=float, default=900,
                        help="seconds for the whole driver, all its runs together")
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
