"""scripts/device_torch_checks.py and scripts/gpu_e2e_llama.py run only on the GPU
machine, where a mistake in their verdicts would cost a scarce device session. Here their
main()/driver() run with canned outputs in place of the subprocesses: every line prints,
a full set of good outputs passes, and each check's failure fails the run. The e2e link
probe runs on a fake of the few torch.cuda calls it makes, with copies that overlap only
when they are on different streams; scripts/device-check runs on this machine, which has
no GPU, and must stop at once; it parses, each benchmark it runs is built and its filter
selects benchmarks, and its summary table (scripts/device_summary.py) shows the counters
the targets judge, also for a benchmark cut short."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import time
import types
from contextlib import contextmanager

import pytest

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "..", "scripts")
SCRIPT = os.path.join(SCRIPTS, "device_torch_checks.py")

N = float(8 << 20)  # the record_stream check's tensor: its sum

GOOD = {
    "native-reference": "[1.0, 0.5]",
    "global": "[1.0, 0.5]\nstats ok",
    "pool": f"REGION_BYTES {64 << 20}\nSNAPSHOT {{}}",
    "oom": "EXC OutOfMemoryError | too big\nLAST_ERROR tidepool: out of memory\nALIVE 2.0",
    "record_stream": f"REUSED False SIDE_BUSY True SUM {N} EXPECTED {N}",
    "memory_api": "PEAK 100 RESERVED 200 AFTER_EMPTY 0 SUMMARY True RESET True",
    "memory_fraction": "EXC OutOfMemoryError FRACTION_NAMED True GET 0.1",
    "cuda_graph": "EXC RuntimeError POOL_MODE_NAMED True",
    "memory_history": ("ACTIONS ['alloc', 'free_completed', 'free_requested', 'oom', 'snapshot'] "
                       "ALLOCS_WITH_STACKS 12 LIVE_WITH_STACKS 3 OF 3 OOM_OBSERVED 1 DUMPED True "
                       "PROFILED_OPS 7"),
    "resume": "TIERED 2 OF 2 SAME True",
    "lbfgs-native": "LOSSES [1.25, 0.5, 0.25, 0.125]",
    # the direction, the last gradient and 2 x 6 history vectors of 4 MiB (the weight's
    # and the bias's, flattened together)
    "lbfgs": ("TIERED 14 OF 14 ON_HOST 58777600 STATE 58777600 "
              "LOSSES [1.25, 0.5, 0.25, 0.125]"),
    # two 128 MiB moments (and the bias's) in host memory, both saved as a kernel reads them
    "big_checkpoint": "ON_HOST 268468224 CHECKED 2 EQUAL 2",
    "step_raises": "RAISED boom AFTER_RAISE_IN_TIDEPOOL 0 STATE_IN_TIDEPOOL 8392704",
    "step_closure": "CLOSURE_IN_TIDEPOOL 0 STATE_IN_TIDEPOOL 8392704",
    # The H200's figures (2026-12-04): 20 MiB + 2 MiB segments hold the discriminator's
    # state, 2 x 16 MiB only the generator's.
    "two_optimizers": ("MOVED_D 23068672 RANGES_D 23068672 RANGES_G_ONLY 33554432 "
                       "STATE_D 8392704 STATE_G 33570816"),
    "two_threads": ("DEVICE_AT_B 23068672 DEVICE_DURING_B 23068672 RANGES_B 23068672 "
                    "RANGES_B_ONLY 20971520 STATE_B 16785408 AFTER 0 ERRORS 0"),
    "cudnn_benchmark": "VIA torch_cuda\nTRAINED",
    "preload_direct": f"DIRECT True SUM {float(9 << 20)} SHIM 1",
}

BAD = {
    "global": "[1.0, 0.7]",
    # the tag made but nothing allocated under it (its name alone is in every snapshot)
    "pool": "REGION_BYTES 0\nSNAPSHOT {}",
    "oom": "NO EXCEPTION\nALIVE 2.0",
    "record_stream": f"REUSED True SIDE_BUSY True SUM {N} EXPECTED {N}",
    "memory_api": "PEAK 100 RESERVED 200 AFTER_EMPTY 300 SUMMARY True RESET True",
    "memory_fraction": "NO EXCEPTION",
    "cuda_graph": "CAPTURED",
    "memory_history": GOOD["memory_history"].replace("PROFILED_OPS 7", "PROFILED_OPS 0"),
    "resume": "TIERED 0 OF 2 SAME True",
    # the history made in later steps left in ordinary device memory
    "lbfgs": ("TIERED 4 OF 14 ON_HOST 16793600 STATE 58777600 "
              "LOSSES [1.25, 0.5, 0.25, 0.125]"),
    # torch.save's copy of one moment differs from what a kernel reads
    "big_checkpoint": "ON_HOST 268468224 CHECKED 2 EQUAL 1",
    "step_raises": "RAISED boom AFTER_RAISE_IN_TIDEPOOL 67108864 STATE_IN_TIDEPOOL 8392704",
    "step_closure": "CLOSURE_IN_TIDEPOOL 67108864 STATE_IN_TIDEPOOL 8392704",
    # both optimizers' state came back for the discriminator's step
    "two_optimizers": ("MOVED_D 56623104 RANGES_D 23068672 RANGES_G_ONLY 33554432 "
                       "STATE_D 8392704 STATE_G 33570816"),
    # a's eviction by tag took b's state from under b's step
    "two_threads": ("DEVICE_AT_B 23068672 DEVICE_DURING_B 0 RANGES_B 23068672 "
                    "RANGES_B_ONLY 20971520 STATE_B 16785408 AFTER 0 ERRORS 0"),
    "cudnn_benchmark": "EXC RuntimeError | does not yet support cacheInfo",
    # the shim preloaded but off (it forwards every call): PyTorch's allocations are not
    # tidepool's
    "preload_direct": f"DIRECT True SUM {float(9 << 20)} SHIM 0",
}


def frozen_clock():
    # Stands in for a script's `time` module: monotonic() stands still, so the share of a
    # deadline a test computes does not depend on how long the test took to get there.
    return types.SimpleNamespace(monotonic=lambda: 1000.0, perf_counter=time.perf_counter,
                                 sleep=time.sleep)


@pytest.fixture
def checks(monkeypatch, tmp_path):
    library = tmp_path / "libtidepool.so"
    library.write_bytes(b"")
    monkeypatch.setenv("TIDEPOOL_LIBRARY", str(library))
    monkeypatch.setenv("TIDEPOOL_TORCH_CUDA_LIBRARY", str(library))
    monkeypatch.setenv("TIDEPOOL_PRELOAD_LIBRARY", str(library))
    spec = importlib.util.spec_from_file_location("device_torch_checks", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_with(module, outputs):
    module.run = lambda name, keep=0.0, **variables: (0, outputs[name], "")
    return module.main()


def test_every_check_has_a_canned_output(checks):
    assert set(checks.CHECKS) == set(GOOD)
    assert set(BAD) == set(GOOD) - {"native-reference", "lbfgs-native"}


def test_good_outputs_pass(checks, capsys):
    assert run_with(checks, GOOD) == 0
    printed = capsys.readouterr().out
    assert "FAIL" not in printed
    for label in ("global", "pool", "oom", "record", "memory", "fraction", "graph", "history",
                  "resume", "lbfgs", "raises", "closure", "two_opt", "threads", "cudnn"):
        assert f"\n{label}" in "\n" + printed, label


def test_the_record_stream_check_runs_alone_after_the_others(checks):
    """It times a side stream against host work, which seven other processes beside it
    on the card could make it lose (it failed so on 2026-12-04)."""
    import threading
    running, seen = set(), []
    lock = threading.Lock()

    kept = {}

    def run(name, keep=0.0, **variables):
        kept.setdefault(name, keep)  # the first run of each (cudnn runs twice)
        with lock:
            seen.append((name, sorted(running)))
            running.add(name)
        time.sleep(0.01)
        with lock:
            running.discard(name)
        return 0, GOOD[name], ""
    checks.run = run
    assert checks.main() == 0
    assert [name for name, _ in seen].count("record_stream") == 1
    assert ("record_stream", []) in seen  # nothing running when it began
    assert not [name for name, beside in seen if "record_stream" in beside]
    order = [name for name, _ in seen]
    assert all(order.index(name) < order.index("record_stream")
               for name in checks.CHECKS if name not in checks.ALONE)
    # Review finding: a hung check run together took all of CHECK_TIMEOUT, leaving the ones
    # run alone none. Those run together keep their time for them.
    assert all(kept[name] == checks.ALONE_SECONDS * len(checks.ALONE)
               for name in checks.CHECKS if name not in checks.ALONE), kept
    assert kept["record_stream"] == 0


@pytest.mark.parametrize("check", sorted(BAD))
def test_each_failing_check_fails_the_run(checks, capsys, check):
    assert run_with(checks, dict(GOOD, **{check: BAD[check]})) == 1
    assert "FAIL" in capsys.readouterr().out


# What else must fail: the read done before the reuse (the check showed nothing), an
# old-format line, a range of the generator's brought back with the discriminator's, a's
# own ranges on the device during b's step, a's end moving a range it shares with b, an
# error in a thread (the run of 2026-12-04 stopped in one with "beginAllocateToPool:
# already recording to mempool_id"), the tag not evicted at the end.
@pytest.mark.parametrize("check, output", [
    ("record_stream", f"REUSED True SIDE_BUSY False SUM {N} EXPECTED {N}"),
    ("record_stream", f"REUSED False SIDE_BUSY False SUM {N} EXPECTED {N}"),
    ("record_stream", f"REUSED False SIDE_BUSY True SUM {2 * N} EXPECTED {N}"),
    ("two_optimizers", "MOVED_D 23068672 STATE_D 8392704 STATE_G 33570816"),
    ("two_optimizers", ("MOVED_D 39845888 RANGES_D 23068672 RANGES_G_ONLY 33554432 "
                        "STATE_D 8392704 STATE_G 33570816")),
    ("two_threads", ("DEVICE_AT_B 44040192 DEVICE_DURING_B 44040192 RANGES_B 23068672 "
                     "RANGES_B_ONLY 20971520 STATE_B 16785408 AFTER 0 ERRORS 0")),
    ("two_threads", ("DEVICE_AT_B 23068672 DEVICE_DURING_B 20971520 RANGES_B 23068672 "
                     "RANGES_B_ONLY 20971520 STATE_B 16785408 AFTER 0 ERRORS 0")),
    ("two_threads", ("DEVICE_AT_B 23068672 DEVICE_DURING_B 23068672 RANGES_B 23068672 "
                     "RANGES_B_ONLY 20971520 STATE_B 16785408 AFTER 0 ERRORS 1 "
                     "RuntimeError('beginAllocateToPool')")),
    ("two_threads", ("DEVICE_AT_B 23068672 DEVICE_DURING_B 23068672 RANGES_B 23068672 "
                     "RANGES_B_ONLY 20971520 STATE_B 16785408 AFTER 23068672 ERRORS 0")),
    # LBFGS: tiered but left on the device; other losses than on PyTorch's allocator; no state
    ("lbfgs", ("TIERED 14 OF 14 ON_HOST 0 STATE 58777600 LOSSES [1.25, 0.5, 0.25, 0.125]")),
    ("lbfgs", ("TIERED 14 OF 14 ON_HOST 58777600 STATE 58777600 "
               "LOSSES [1.25, 0.5, 0.25, 0.25]")),
    ("lbfgs", ("TIERED 0 OF 0 ON_HOST 0 STATE 0 LOSSES [1.25, 0.5, 0.25, 0.125]")),
    ("lbfgs-native", "Traceback (most recent call last)"),
])
def test_these_outputs_fail_too(checks, capsys, check, output):
    assert run_with(checks, dict(GOOD, **{check: output})) == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_crashed_check_fails_the_run(checks):
    checks.run = lambda name, keep=0.0, **variables: ((1, "", "[exit 1] Segmentation fault")
                                            if name == "resume" else (0, GOOD[name], ""))
    assert checks.main() == 1


def test_output_of_an_unexpected_shape_fails_its_check_alone(checks, capsys):
    # int() of a field that is no number: before, the exception lost every verdict.
    outputs = dict(GOOD, memory_api="PEAK n/a RESERVED 200 AFTER_EMPTY 0 SUMMARY True RESET True")
    assert run_with(checks, outputs) == 1
    printed = capsys.readouterr().out
    assert "memory   FAIL" in printed
    assert "resume   PASS" in printed and "cudnn    PASS" in printed


def test_an_empty_reference_fails_global_without_an_exception(checks, capsys):
    assert run_with(checks, dict(GOOD, **{"native-reference": ""})) == 1
    assert "global   FAIL" in capsys.readouterr().out


def test_each_check_gets_what_is_left_of_check_timeout(checks, monkeypatch):
    seen = {}

    def fake_run(cmd, timeout, **kwargs):
        seen["timeout"] = timeout
        return subprocess.CompletedProcess(cmd, 0, "out", "")
    monkeypatch.setattr(checks.subprocess, "run", fake_run)
    monkeypatch.setattr(checks, "time", frozen_clock())  # a stall here changes nothing
    monkeypatch.setattr(checks, "DEADLINE", checks.time.monotonic() + 40)
    assert checks.run("resume") == (0, "out", "")
    assert seen["timeout"] == 40 - checks.VERDICT_SECONDS
    # What the checks run together keep for those run alone after them (review finding: a
    # hung check took all of CHECK_TIMEOUT, and record_stream was not run).
    assert checks.run("resume", keep=checks.ALONE_SECONDS) == (0, "out", "")
    assert seen["timeout"] == 40 - checks.VERDICT_SECONDS - checks.ALONE_SECONDS
    monkeypatch.setattr(checks, "DEADLINE", checks.time.monotonic() + 2)
    rc, _, err = checks.run("resume")
    assert rc == 124 and "not run" in err


# ---- scripts/gpu_e2e_llama.py ----------------------------------------------------------

E2E = os.path.join(SCRIPTS, "gpu_e2e_llama.py")
GB = 10 ** 9
LOSSES = [float.hex(x) for x in (10.770337104797363, 10.76805591583252)]
STATE = 8_800_000_000
LINK = {"probe_bytes": 256 << 20, "repeats": 5, "h2d_gbps": 55.0, "d2h_gbps": 50.0,
        "both_ways_gbps": 100.0}


def e2e_runs():
    """One good run of each kind, with the 2026-12-04 H200 figures' shape."""
    run = {"losses": LOSSES, "losses_readable": [10.77, 10.768], "params": STATE // 8,
           "state_bytes": STATE}
    return {
        "plain": dict(run, mode="plain", steady_step_seconds=0.341, link=dict(LINK),
                      peak_device_bytes={"first_step": 23 * GB, "steady": 27 * GB}),
        "tidepool": dict(run, mode="tidepool", steady_step_seconds=0.517,
                         peak_device_bytes={"first_step": 17 * GB, "steady": 17 * GB}),
        "cap_plain": {"mode": "cap_plain", "oom": "CUDA out of memory", "losses": []},
        "cap_tidepool": dict(run, mode="cap_tidepool"),
        "preload": dict(run, mode="preload",
                        tidepool_stats={"allocated_bytes.all.peak": 20 * GB}),
    }


@pytest.fixture
def e2e(monkeypatch):
    monkeypatch.setenv("TIDEPOOL_PRELOAD_LIBRARY", "/nonexistent/libtidepool_preload.so")
    spec = importlib.util.spec_from_file_location("gpu_e2e_llama", E2E)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def drive(module, runs, tmp_path):
    module.run_worker = lambda name, args, env, extra=(): json.loads(json.dumps(runs[name]))
    args = argparse.Namespace(device="cuda", timeout=100.0, out=str(tmp_path / "e2e.json"),
                              steps=2, layers=22, batch=4, seq=512, tiny=False)
    rc = module.driver(args)
    summary = json.loads((tmp_path / "e2e.json").read_text())
    return rc, summary


def test_e2e_good_runs_pass_with_the_floor_at_the_measured_rate(e2e, tmp_path, capsys):
    rc, summary = drive(e2e, e2e_runs(), tmp_path)
    assert rc == 0 and summary["result"] == "PASS"
    t = summary["step_time"]
    floor = 2 * STATE / (LINK["both_ways_gbps"] * GB)  # 0.176 s
    assert t["link_floor_s"] == pytest.approx(floor)
    assert t["overhead_s"] == pytest.approx(0.176)
    assert t["overhead_over_floor"] == pytest.approx(0.176 / floor)
    printed = capsys.readouterr().out
    # The lines device-check shows (grep '^\[e2e|passed|result').
    assert "[e2e] link, pinned, measured in this run (256 MiB, best of 5): H2D 55.0 GB/s, " \
           "D2H 50.0 GB/s, both at once 100.0 GB/s" in printed
    assert "2 x 8.80 GB at 100.0 GB/s) 0.176 s: 1.00x" in printed
    assert "7 passed, 0 failed" in printed


def test_e2e_floor_follows_the_link_rate_of_the_run(e2e, tmp_path):
    runs = e2e_runs()
    runs["plain"]["link"]["both_ways_gbps"] = 50.0
    _, summary = drive(e2e, runs, tmp_path)
    assert summary["step_time"]["link_floor_s"] == pytest.approx(2 * STATE / (50 * GB))
    assert not hasattr(e2e, "LINK_GBPS_BOTH_WAYS")


def test_e2e_without_a_link_figure_gives_no_floor(e2e, tmp_path, capsys):
    runs = e2e_runs()
    runs["plain"]["link"] = {"error": "RuntimeError: no pinned memory"}
    rc, summary = drive(e2e, runs, tmp_path)
    assert rc == 0  # the floor is reported, not checked
    assert summary["step_time"]["link_floor_s"] is None
    assert summary["step_time"]["overhead_over_floor"] is None
    assert "[e2e] link: not measured (RuntimeError: no pinned memory)" in capsys.readouterr().out


@pytest.mark.parametrize("run, change, failing", [
    # printed its results, then crashed (at exit, say)
    ("tidepool", {"failed": "exit -11"}, "tidepool_run_completed"),
    ("tidepool", {"losses": LOSSES[:1] + ["0x1p+0"]}, "same_losses_bitwise"),
    ("tidepool", {"peak_device_bytes": {"first_step": 26 * GB, "steady": 17 * GB}},
     "peak_lower_by_90pct_of_state"),
    ("cap_plain", {"oom": None}, "cap_plain_runs_out_of_memory"),
    ("cap_tidepool", {"oom": "CUDA out of memory"}, "cap_tidepool_trains"),
    ("cap_tidepool", {"failed": "timed out after 60 s"}, "cap_tidepool_trains"),
    ("preload", {"failed": "exit -6"}, "preload_same_losses"),
    ("preload", {"tidepool_stats": {"allocated_bytes.all.peak": 0}},
     "preload_served_by_tidepool"),
])
def test_e2e_each_failure_fails_the_run(e2e, tmp_path, run, change, failing):
    runs = e2e_runs()
    runs[run].update(change)
    runs[run] = {k: v for k, v in runs[run].items() if v is not None}
    rc, summary = drive(e2e, runs, tmp_path)
    assert rc == 1
    assert summary["result"].startswith("FAIL") and failing in summary["result"]


def test_e2e_runs_left_without_time_are_not_run_not_failed(e2e, tmp_path, capsys):
    runs = e2e_runs()
    for name in ("cap_tidepool", "preload"):
        runs[name] = {"mode": name, "failed": "not run: 3 s of --timeout left"}
    rc, summary = drive(e2e, runs, tmp_path)
    assert rc == e2e.EXIT_NOT_RUN
    assert summary["result"] == ("NOT RUN (no time left): cap_tidepool_trains, "
                                 "preload_same_losses, preload_served_by_tidepool")
    assert summary["checks"]["cap_tidepool_trains"]["ok"] is None
    assert "4 passed, 0 failed, 3 not run (no time left)" in capsys.readouterr().out
    runs["cap_plain"]["oom"] = None  # and a real failure beside them is a failure
    runs["cap_plain"] = {k: v for k, v in runs["cap_plain"].items() if v is not None}
    rc, summary = drive(e2e, runs, tmp_path)
    assert rc == 1 and summary["result"] == "FAIL: cap_plain_runs_out_of_memory"


def test_e2e_a_plain_run_that_cannot_run_says_so(e2e, tmp_path):
    runs = e2e_runs()
    runs["plain"] = {"mode": "plain", "cannot_run": "no CUDA device"}
    rc, summary = drive(e2e, runs, tmp_path)
    assert rc == e2e.EXIT_CANNOT_RUN
    assert summary["result"] == "CANNOT RUN: the plain run: no CUDA device"


def test_e2e_runs_share_the_driver_timeout(e2e, monkeypatch, capsys):
    seen = []

    def fake_run(cmd, timeout, **kwargs):
        seen.append(timeout)
        return subprocess.CompletedProcess(cmd, 0, 'warning\n{"mode": "plain"}\n{broken\n', "")
    monkeypatch.setattr(e2e.subprocess, "run", fake_run)
    monkeypatch.setattr(e2e, "time", frozen_clock())  # a stall here changes nothing
    args = argparse.Namespace(device="cuda", steps=2, layers=22, batch=4, seq=512, tiny=False,
                              deadline=e2e.time.monotonic() + 60)
    out = e2e.run_worker("plain", args, {})
    assert out["mode"] == "plain" and "failed" not in out  # the last line that parses
    assert seen[0] == 60 - e2e.SUMMARY_SECONDS
    args.deadline = e2e.time.monotonic() + 5
    out = e2e.run_worker("tidepool", args, {})
    assert out["failed"].startswith("not run") and len(seen) == 1


class FakeCuda:
    """The torch.cuda calls measure_link makes, on a model device: each stream runs its
    work in order, a copy takes its bytes over the rate of its direction (its first one
    ten times that), and streams run side by side unless one waits for another."""

    RATE = {"h2d": 55e9, "d2h": 50e9}

    def __init__(self):
        self.main = self.Stream(self)
        self.current = self.main
        self.copies = {"h2d": 0, "d2h": 0}
        fake = self

        class Event:
            def __init__(self, enable_timing=False):
                assert enable_timing
                self.t = None

            def record(self, stream):
                self.t = stream.t

            def synchronize(self):
                assert self.t is not None

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3

        self.Event = Event
        self.Stream = lambda: FakeCuda.Stream(fake)

    class Stream:
        def __init__(self, fake):
            self.t = 0.0

        def wait_stream(self, other):
            self.t = max(self.t, other.t)

    def current_stream(self):
        return self.current

    @contextmanager
    def stream(self, s):
        previous, self.current = self.current, s
        yield
        self.current = previous

    def synchronize(self):
        pass

    def _sleep(self, cycles):
        self.current.t += cycles * 1e-9

    def copy(self, dst, src):
        way = "h2d" if dst.on_device else "d2h"
        assert dst.on_device != src.on_device and (dst.pinned or src.pinned)
        self.copies[way] += 1
        slow = 10 if self.copies[way] == 1 else 1
        self.current.t += slow * dst.nbytes / self.RATE[way]


class FakeTorch:
    uint8 = "uint8"

    def __init__(self):
        self.cuda = FakeCuda()

    def empty(self, nbytes, dtype, pin_memory=False, device=None):
        cuda = self.cuda

        class Tensor:
            def __init__(self):
                self.nbytes, self.pinned, self.on_device = nbytes, pin_memory, device == "cuda"

            def copy_(self, src, non_blocking=False):
                assert non_blocking  # a blocking copy would serialise the two streams
                cuda.copy(self, src)

        return Tensor()


def test_e2e_link_probe_overlaps_the_directions_and_takes_the_best(e2e):
    rates = e2e.measure_link(FakeTorch(), nbytes=256 << 20, repeats=3)
    assert rates["h2d_gbps"] == pytest.approx(55.0)
    assert rates["d2h_gbps"] == pytest.approx(50.0)
    # Both at once: 2 x 256 MiB in the time of the slower direction. Copies made one after
    # the other would read 26.2 GB/s.
    assert rates["both_ways_gbps"] == pytest.approx(2 * 50.0)
    assert rates["probe_bytes"] == 256 << 20 and rates["repeats"] == 3


# ---- scripts/device-check --------------------------------------------------------------

def gpu_visible():
    try:
        import torch
        return torch.cuda.device_count() > 0
    except ImportError:
        return shutil.which("nvidia-smi") is not None


@pytest.mark.skipif(gpu_visible(), reason="a GPU is visible: device-check would run for real")
def test_device_check_stops_at_once_without_a_gpu(tmp_path):
    # A copy of the script in a tree of its own: its logs go beside it, not into the repo.
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "device-check"
    shutil.copy(os.path.join(SCRIPTS, "device-check"), script)
    out = tmp_path / "out"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OUT=str(out)))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "no CUDA device is visible" in proc.stdout
    assert not (tmp_path / "build-device").exists()  # no build was started
    listing = subprocess.run(["tar", "tzf", str(out / "device-check.tgz")], capture_output=True,
                             text=True, check=True).stdout
    assert "./phases.txt" in listing.split()
    assert os.listdir(out) == ["device-check.tgz"]  # no part file of a pack left behind


# ---- scripts/device-check's own plumbing ------------------------------------------------

DEVICE_CHECK = os.path.join(SCRIPTS, "device-check")


def test_device_check_parses():
    """bash reads a script as it runs: a syntax error past the GPU gate would show only on
    the GPU machine, whose time is short."""
    subprocess.run(["bash", "-n", DEVICE_CHECK], check=True)


def build_folder():
    library = os.environ.get("TIDEPOOL_LIBRARY", "")
    return os.path.dirname(os.path.dirname(library)) if library else None


def test_each_benchmark_device_check_runs_selects_benchmarks():
    """Every benchmark line of device-check names a binary the build makes and arguments
    it takes, and its filter still selects benchmarks (the GPU ones are listed on a build
    without a GPU too): a renamed benchmark would otherwise be missed on the GPU alone."""
    build = build_folder()
    if build is None:
        pytest.skip("TIDEPOOL_LIBRARY is not set: no build to list the benchmarks of")
    lines = subprocess.run(["bash", DEVICE_CHECK, "--list-benchmarks"], capture_output=True,
                           text=True, check=True).stdout.splitlines()
    assert [line.split()[0] for line in lines] == [
        "alloc", "alloc_c10", "lstsq", "tiering", "optim", "aadl"]
    for line in lines:
        name, cap, least, binary, *args = line.split()
        assert int(least) < int(cap), line
        path = os.path.join(build, binary)
        if not os.path.exists(path):
            pytest.skip(f"{binary} is not built here (TIDEPOOL_BUILD_BENCH off?)")
        listed = subprocess.run([path, "--benchmark_list_tests", *args], capture_output=True,
                                text=True, timeout=60)
        assert listed.returncode == 0, (line, listed.stderr)
        assert listed.stdout.split(), f"{name}: {args} selects no benchmark"


def load_summary():
    spec = importlib.util.spec_from_file_location(
        "device_summary", os.path.join(SCRIPTS, "device_summary.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_summary_shows_the_counters_targets_judge_first(tmp_path):
    rows = [
        {"name": "BM_Gpu_Apollo_Fused_Tiered/268435456", "run_type": "iteration",
         "real_time": 61.5, "time_unit": "ms", "B/param": 24.0, "acquire_wait_ms": 3.0,
         "budget_waits": 0.0, "d2h_GB/s": 50.1, "floor_ratio": 1.19, "iterations": 3},
        {"name": "store/bidir/manual_time_mean", "run_type": "aggregate",
         "aggregate_name": "mean", "real_time": 9.0, "time_unit": "ms", "GBps": 80.0},
        {"name": "store/bidir/manual_time_median", "run_type": "aggregate",
         "aggregate_name": "median", "real_time": 8.0, "time_unit": "ms", "GBps": 81.0,
         "allocator_maps": 0.0, "ratio_vs_memcpy": 0.91, "repetitions": 3},
        {"name": "store/bidir/manual_time", "run_type": "iteration", "repetitions": 3,
         "real_time": 8.1, "time_unit": "ms"},
        {"name": "BM_Gpu_AADL_Tiered/268435456", "run_type": "iteration",
         "error_occurred": True, "error_message": "no CUDA device"},
    ]
    (tmp_path / "optim.json").write_text(json.dumps({"benchmarks": rows}))
    (tmp_path / "e2e.json").write_text(json.dumps({"result": "PASS"}))  # not a benchmark's
    lines = load_summary().summary(tmp_path)
    assert len(lines) == 3
    assert "floor_ratio=1.19 d2h_GB/s=50.1" in lines[0]
    assert "_mean" not in "\n".join(lines)
    assert "ratio_vs_memcpy=0.91 GBps=81" in lines[1]
    assert "SKIPPED: no CUDA device" in lines[2]


def test_the_summary_says_the_errors_of_a_repeated_benchmark(tmp_path):
    """Review finding: the errored repetitions of a repeated benchmark were dropped with its
    other repetitions, so a row whose repetitions all failed (no median) vanished."""
    error = {"name": "store/h2d/manual_time", "run_type": "iteration", "repetitions": 3,
             "error_occurred": True, "error_message": "the store moved 1 of 2 bytes"}
    (tmp_path / "tiering.json").write_text(json.dumps({"benchmarks": [error] * 3}))
    lines = load_summary().summary(tmp_path)
    assert len(lines) == 1
    assert "store/h2d/manual_time" in lines[0]
    assert "SKIPPED: the store moved 1 of 2 bytes" in lines[0]


def test_the_summary_always_shows_whether_a_row_is_a_fair_measurement(tmp_path):
    """Counters past the first few that say whether the row measured what it claims
    (review finding: pageable_MiB and memlock_capped, the suspects of a 17.7x row, never
    reached the table)."""
    row = {"name": "BM_Gpu_Apollo_Fused_Tiered/268435456", "run_type": "iteration",
           "real_time": 61.5, "time_unit": "ms", "floor_ratio": 1.19, "d2h_GB/s": 50.1,
           "h2d_GB/s": 48.0, "acquire_wait_ms": 3.0, "budget_waits": 0.0, "exposed_ms": 0.1,
           "late": 0.0, "misses": 0.0, "pageable_MiB": 512.0, "memlock_capped": 1.0,
           "skipped": 2.0, "B/param": 26.25}
    (tmp_path / "optim.json").write_text(json.dumps({"benchmarks": [row]}))
    (line,) = load_summary().summary(tmp_path)
    for shown in ("floor_ratio=1.19", "pageable_MiB=512", "memlock_capped=1", "skipped=2",
                  "B/param=26.25"):
        assert shown in line, line
    assert "late=" not in line and "misses=" not in line


def test_the_console_fallback_leaves_out_aggregates_but_the_median(tmp_path):
    (tmp_path / "tiering.json").write_text('{"context": {}, "benchmarks": [{"name": "memc')
    (tmp_path / "tiering.txt").write_text(
        "store/bidir/manual_time   20.9 ms   0.007 ms   3 GBps=12.86\n"
        "store/bidir/manual_time_mean   20.9 ms   0.007 ms   3 GBps=12.86\n"
        "store/bidir/manual_time_median   20.8 ms   0.007 ms   3 GBps=12.9\n"
        "store/bidir/manual_time_stddev   0.1 ms   0.001 ms   3 GBps=0.1\n"
        "store/bidir/manual_time_cv   0.01 ms   0.001 ms   3 GBps=0.01\n")
    names = [line.split()[1] for line in load_summary().summary(tmp_path)]
    assert names == ["store/bidir/manual_time", "store/bidir/manual_time_median"]


def test_the_summary_reads_a_benchmark_cut_short_from_its_console_log(tmp_path):
    (tmp_path / "tiering.json").write_text('{"context": {}, "benchmarks": [{"name": "memc')
    (tmp_path / "tiering.txt").write_text(
        "Running bench\n"
        "-------------------------------------------------------------------\n"
        "memcpy/h2d/manual_time   20.9 ms   0.007 ms   3 GBps=12.86 tensors=31\n"
        "store/prefetch_h2d/manual_time   35.2 ms   0.306 ms   1 GBps=7.62 "
        "ratio_vs_memcpy=0.598\n")
    lines = load_summary().summary(tmp_path)
    assert len(lines) == 2
    assert lines[1].startswith("tiering   store/prefetch_h2d/manual_time")
    assert "ratio_vs_memcpy=0.598" in lines[1] and "cut short" in lines[1]


def test_device_check_refuses_a_misspelt_phase(tmp_path):
    """A phase it does not know would be skipped without a word, on the GPU."""
    (tmp_path / "scripts").mkdir()
    script = tmp_path / "scripts" / "device-check"
    shutil.copy(DEVICE_CHECK, script)
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, OUT=str(tmp_path / "out"),
                                   DEVICE_PHASES="build e2e tset"))
    assert proc.returncode == 2
    assert "unknown phase 'tset'" in proc.stdout
    assert not (tmp_path / "build-device").exists()
