"""scripts/device_torch_checks.py runs only on the GPU machine, where a mistake in its
verdicts would cost a scarce device session. Here its main() runs with canned check
outputs in place of the subprocesses: every line prints, a full set of good outputs
passes, and each check's failure fails the run."""

from __future__ import annotations

import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "device_torch_checks.py")

N = float(8 << 20)  # the record_stream check's tensor: its sum

GOOD = {
    "native-reference": "[1.0, 0.5]",
    "global": "[1.0, 0.5]\nstats ok",
    "pool": "device_check_region 64MiB",
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
    "preload_direct": f"DIRECT True SUM {float(9 << 20)}",
}

BAD = {
    "global": "[1.0, 0.7]",
    "pool": "no region",
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
    # libtidepool's direct malloc failed under the shim
    "preload_direct": f"DIRECT False SUM {float(9 << 20)}",
}


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
    module.run = lambda name, **variables: (0, outputs[name], "")
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
    checks.run = lambda name, **variables: ((1, "", "[exit 1] Segmentation fault")
                                            if name == "resume" else (0, GOOD[name], ""))
    assert checks.main() == 1
