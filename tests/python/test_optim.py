"""tidepool.optim (Apollo, AADL through the binding tidepool._optim), on the CPU:

- every golden trajectory of ../shared/golden (the published Apollo and AADL), through the
  Python classes, in each placement, fused and not;
- placement does not change results (bitwise), save -> load -> continue equals an
  uninterrupted run, and Apollo's state_dict has the reference's layout: checkpoints move
  between the published Apollo (reference_apollo.py) and this one both ways;
- LR schedulers and added parameter groups reach the C++ step; closures (their loss,
  their exceptions);
- bad options, bad state_dicts, sparse gradients and unsupported dtypes are refused with
  a clear error and change nothing;
- the drop-in's step hooks leave tidepool.optim's optimizers alone.

ctest sets TIDEPOOL_OPTIM_MODULE to the built binding; without it (a build without
Python's headers) these tests are skipped, saying so.
"""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import weakref

import pytest
import torch

import tidepool.optim as topt
from tidepool import _lib

from optim_binding import skip_without_binding
from golden_problems import GOLDEN, GOLDEN_TOLERANCE, SHARED, Golden, deviation
from reference_apollo import ReferenceApollo
from optim_problems import assert_bitwise, regression_problem, snapshot, train

skip_without_binding()


# ---- problems ---------------------------------------------------------------------------------

def make_golden_optimizer(golden: Golden, params, where: str, fused: bool = True):
    spec = dict(golden.optimizer)
    kind = spec.pop("type")
    if kind == "Apollo":
        return topt.Apollo(params, state=where, fused=fused, **spec)
    assert kind == "AADL"
    base = getattr(torch.optim, spec["base"])(params, **spec["base_options"])
    return topt.AADL(base, history=where, **spec["accelerate"])


def run_golden(golden: Golden, where: str, fused: bool = True):
    params = golden.params()
    return golden.follow(make_golden_optimizer(golden, params, where, fused), params)


# ---- golden trajectories ------------------------------------------------------------------------

def test_a_nan_is_an_infinite_golden_deviation():
    """The golden measure must fail a run gone NaN (max(0.0, nan) is 0.0 in Python)."""
    want = torch.tensor([1.0, 2.0], dtype=torch.float64)
    nan = torch.tensor([1.0, float("nan")], dtype=torch.float64)
    assert max(0.0, deviation(nan, want)) == float("inf")
    assert deviation(want, want) == 0.0


def test_the_golden_files_are_there():
    assert len(GOLDEN) >= 6, f"no golden trajectories under {SHARED}/golden"


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: os.path.basename(p)[:-5])
@pytest.mark.parametrize("where", ["device", "host", "tiered"])
def test_golden_trajectory(path, where):
    golden = Golden(path)
    worst = run_golden(golden, where)
    assert worst <= GOLDEN_TOLERANCE, f"{golden.name}: deviation {worst:.3e}"


@pytest.mark.parametrize("path", [p for p in GOLDEN if "apollo" in os.path.basename(p)],
                         ids=lambda p: os.path.basename(p)[:-5])
def test_golden_trajectory_without_fused_kernels(path):
    assert run_golden(Golden(path), "device", fused=False) <= GOLDEN_TOLERANCE


@pytest.mark.parametrize("path", [p for p in GOLDEN if "apollo" in os.path.basename(p)],
                         ids=lambda p: os.path.basename(p)[:-5])
@pytest.mark.parametrize("first, then", [(ReferenceApollo, topt.Apollo),
                                         (topt.Apollo, ReferenceApollo)],
                         ids=["reference_to_tidepool", "tidepool_to_reference"])
def test_checkpoints_move_between_the_published_apollo_and_this_one(path, first, then):
    """Half the golden run with one, its state_dict through torch.save, the rest with the
    other (made with another lr: the options come from the checkpoint): the golden
    trajectory all the same. ReferenceApollo (reference_apollo.py) keeps its state as
    the published Apollo does, and follows the golden runs too (checked here first)."""
    golden = Golden(path)
    spec = {k: v for k, v in golden.optimizer.items() if k != "type"}
    params = golden.params()
    half = len(golden.steps) // 2
    optimizer = first(params, **spec)
    worst = 0.0
    for index, ref in enumerate(golden.steps):
        if index == half:
            buffer = io.BytesIO()
            torch.save(optimizer.state_dict(), buffer)
            buffer.seek(0)
            optimizer = then(params, **{**spec, "lr": 0.5})
            optimizer.load_state_dict(torch.load(buffer))
            assert optimizer.param_groups[0]["lr"] == spec["lr"]
        optimizer.zero_grad()
        golden.loss(params).backward()
        optimizer.step()
        for got, want in zip(params, ref["params"]):
            worst = max(worst, deviation(got.detach().reshape(-1),
                                         torch.tensor(want, dtype=torch.float64)))
    assert worst <= GOLDEN_TOLERANCE, f"{golden.name}: deviation {worst:.3e}"


# ---- placement, checkpoints ---------------------------------------------------------------------

@pytest.mark.parametrize("where", ["host", "tiered"])
def test_apollo_placement_does_not_change_results(where):
    results = []
    for placement in ("device", where):
        params, tensors, loss = regression_problem(groups=2)
        opt = topt.Apollo(params, lr=0.05, warmup=3, rebound="belief", weight_decay=1e-3,
                          state=placement)
        train(opt, loss, 12)
        results.append(snapshot(tensors))
    assert_bitwise(*results)


@pytest.mark.parametrize("where", ["device", "tiered"])
def test_aadl_history_placement_does_not_change_results(where):
    results = []
    for placement in ("host", where):
        params, tensors, loss = regression_problem()
        opt = topt.AADL(torch.optim.Adam(params, lr=0.05), relaxation=0.5, history_depth=4,
                        history=placement)
        train(opt, loss, 12)
        results.append(snapshot(tensors))
    assert_bitwise(*results)


def test_tiered_state_reports_its_store():
    params, tensors, loss = regression_problem()
    opt = topt.Apollo(params, lr=0.05, state="tiered", state_budget=1 << 20)
    train(opt, loss, 3)
    stats = opt.placement_stats()
    assert stats["placement"] == "tiered"
    assert stats["device_budget_bytes"] == 1 << 20
    assert stats["state_bytes"] == 3 * sum(t.nbytes for t in tensors)
    assert opt.placement == "tiered"

    aadl = topt.AADL(torch.optim.SGD(params, lr=0.1), history_depth=3, history="tiered",
                     history_budget=1 << 20)
    train(aadl, loss, 4)
    stats = aadl.placement_stats()
    assert stats["placement"] == "tiered" and stats["device_budget_bytes"] == 1 << 20
    # Three vectors of all parameters, and the spare a tiered history keeps for reuse.
    assert stats["state_bytes"] == 4 * sum(t.nbytes for t in tensors)
    assert topt.AADL(torch.optim.SGD(params, lr=0.1)).placement_stats()["placement"] == \
        "resident"  # "host" for CPU parameters


def test_evict_by_tag_reaches_tiered_state_when_no_range_is_on_the_device():
    # Review finding: tidepool.evict skipped its C call when none of the tag's pointer-stable
    # ranges was on the device, but the device's tiered stores hold state of the tag too
    # (here all of it): their handles stayed on the device.
    import tidepool
    params, tensors, loss = regression_problem()
    opt = topt.Apollo(params, lr=0.05, state="tiered", state_budget=64 << 20)
    train(opt, loss, 3)
    before = tidepool.stats(0)
    assert before["tiering.device_bytes"] > 0
    tidepool.evict("optimizer_state", device=0)
    after = tidepool.stats(0)
    # Every handle (the buffers go once their copies back are done, in stream order).
    assert after["tiering.evictions"] - before["tiering.evictions"] == len(opt.state_dict()[
        "state"]) * 3
    train(opt, loss, 1)  # and the state comes back for the next step


@pytest.mark.parametrize("where", ["device", "tiered"])
def test_apollo_save_load_continue_equals_an_uninterrupted_run(where):
    params, tensors, loss = regression_problem(groups=2)
    straight = topt.Apollo(params, lr=0.05, warmup=4, state=where)
    train(straight, loss, 10)
    expected = snapshot(tensors)

    params, tensors, loss = regression_problem(groups=2)
    first = topt.Apollo(params, lr=0.05, warmup=4, state=where)
    train(first, loss, 5)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = topt.Apollo(params, lr=0.9, warmup=1, state=where)  # options come from the file
    resumed.load_state_dict(torch.load(buffer))
    assert resumed.param_groups[0]["lr"] == 0.05 and resumed.param_groups[1]["lr"] == 0.02
    train(resumed, loss, 5)
    assert_bitwise(expected, snapshot(tensors))


def test_apollo_state_dict_has_the_reference_layout():
    params, tensors, loss = regression_problem(groups=2)
    opt = topt.Apollo(params, lr=0.05)
    fresh = opt.state_dict()["state"]  # the state the first step starts from
    assert sorted(fresh) == [0, 1] and all(entry["step"] == 0 for entry in fresh.values())
    assert all(not entry[key].any() for entry in fresh.values()
               for key in ("exp_avg_grad", "approx_hessian", "update"))
    train(opt, loss, 2)
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1]
    for index, t in enumerate(tensors):
        entry = sd["state"][index]
        assert entry["step"] == 2
        assert set(entry) == {"step", "exp_avg_grad", "approx_hessian", "update"}
        for key in ("exp_avg_grad", "approx_hessian", "update"):
            assert entry[key].shape == t.shape and entry[key].dtype == t.dtype
    assert [g["params"] for g in sd["param_groups"]] == [[0], [1]]
    group = sd["param_groups"][1]  # its own lr; the rest from the constructor's, as the
    assert group["lr"] == 0.02 and group["init_lr"] == pytest.approx(0.05 / 1000)  # reference
    assert group["base_lr"] == 0.05 and group["weight_decay_type"] == "L2"


def test_apollo_runs_the_state_dict_hooks():
    params, tensors, loss = regression_problem()
    opt = topt.Apollo(params, lr=0.05)
    train(opt, loss, 1)
    calls = []
    opt.register_state_dict_pre_hook(lambda o: calls.append("save-pre"))
    opt.register_state_dict_post_hook(
        lambda o, sd: calls.append("save-post") or {**sd, "note": "from a hook"})
    opt.register_load_state_dict_pre_hook(
        lambda o, sd: calls.append("load-pre") or {k: v for k, v in sd.items() if k != "note"})
    opt.register_load_state_dict_post_hook(lambda o: calls.append("load-post"))
    sd = opt.state_dict()
    assert sd["note"] == "from a hook"
    opt.load_state_dict(sd)
    assert calls == ["save-pre", "save-post", "load-pre", "load-post"]


def test_apollo_loads_a_state_dict_in_another_dtype_with_tensor_steps():
    """As PyTorch's optimizers save 'step' (a tensor) and as a float32 run saves state."""
    params, tensors, loss = regression_problem(dtype=torch.float64)
    reference = topt.Apollo(params, lr=0.05, warmup=2)
    train(reference, loss, 3)
    sd = reference.state_dict()
    for entry in sd["state"].values():
        entry["step"] = torch.tensor(float(entry["step"]))
        for key in ("exp_avg_grad", "approx_hessian", "update"):
            entry[key] = entry[key].float()
    twin = topt.Apollo(params, lr=0.05, warmup=2)
    twin.load_state_dict(sd)
    back = twin.state_dict()["state"][0]
    assert back["step"] == 3 and back["update"].dtype == torch.float64
    assert torch.equal(back["update"], sd["state"][0]["update"].double())


@pytest.mark.parametrize("where", ["host", "tiered"])
def test_aadl_save_load_continue_equals_an_uninterrupted_run(where):
    def make(params):
        return topt.AADL(torch.optim.SGD(params, lr=0.1, momentum=0.5), relaxation=0.5,
                         history_depth=4, history=where)
    params, tensors, loss = regression_problem()
    straight = make(params)
    train(straight, loss, 10)
    expected = snapshot(tensors)

    params, tensors, loss = regression_problem()
    first = make(params)
    train(first, loss, 5)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed = make(params)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert resumed.history_size() == first.history_size() == 4
    train(resumed, loss, 5)
    assert_bitwise(expected, snapshot(tensors))


def test_aadl_reads_wait_for_a_step_or_load_in_another_thread():
    """accepted, rejected, history_size and placement_stats read the C++ histories, which a
    load replaces: they wait for the optimizer's other calls (Note [one call at a time];
    review finding: a read beside a load in another thread read freed memory)."""
    import threading
    params, tensors, loss = regression_problem()
    opt = topt.AADL(torch.optim.SGD(params, lr=0.1), history_depth=4)
    train(opt, loss, 3)
    reads = {"accepted": lambda: opt.accepted, "rejected": lambda: opt.rejected,
             "history_size": opt.history_size, "placement_stats": opt.placement_stats}
    for name, read in reads.items():
        done = threading.Event()
        with opt._lock:  # as a load in another thread holds it
            reader = threading.Thread(target=lambda: (read(), done.set()))
            reader.start()
            assert not done.wait(0.2), f"{name} did not wait for the optimizer's lock"
        reader.join(10)
        assert done.is_set(), name


def test_aadl_saves_its_history_as_a_tensor_and_loads_the_bytes_of_earlier_versions():
    # Review finding: the history was one bytes object, which torch.save's pickle protocol
    # 2 writes as a latin-1 string (about 1.5x its size) and refuses beyond 4 GiB.
    def make(params):
        return topt.AADL(torch.optim.SGD(params, lr=0.1), history_depth=3)
    params, tensors, loss = regression_problem()
    first = make(params)
    train(first, loss, 4)
    saved = first.state_dict()["aadl"]
    assert isinstance(saved, torch.Tensor) and saved.dtype == torch.uint8 and saved.dim() == 1
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    assert buffer.tell() < 1.2 * saved.numel() + 64 * 1024  # not 1.5x: a record of its own
    for form in (saved, bytes(saved.numpy()), bytearray(saved.numpy())):
        resumed = make([p.detach().clone().requires_grad_() for p in params])
        resumed.load_state_dict({"inner": first.state_dict()["inner"], "aadl": form})
        assert resumed.history_size() == first.history_size() == 3


# ---- options, schedulers, groups, closures ------------------------------------------------------

def test_an_lr_scheduler_reaches_the_step():
    params, tensors, loss = regression_problem()
    opt = topt.Apollo(params, lr=0.05, warmup=1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 1.0 if epoch < 2 else 0.0)
    for _ in range(2):
        train(opt, loss, 1)
        scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.0
    before = snapshot(tensors)
    train(opt, loss, 2)  # lr 0 after the warmup: nothing moves
    assert_bitwise(before, snapshot(tensors))
    opt.param_groups[0]["lr"] = 0.05
    train(opt, loss, 1)
    assert not torch.equal(before[0], tensors[0])


def test_options_changed_to_bad_ones_are_a_value_error_at_the_step():
    # Review finding: the README promised a ValueError; the C++ step's check was a
    # RuntimeError.
    params, tensors, loss = regression_problem()
    opt = topt.Apollo(params, lr=0.05)
    train(opt, loss, 1)
    before = snapshot(tensors)
    opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="invalid learning rate -1"):
        train(opt, loss, 1)
    assert_bitwise(before, snapshot(tensors))


def test_replaced_or_removed_params_make_the_step_raise():
    # Review finding: a group's "params" replaced (HF Accelerate's parameter switch) was
    # never stepped, without a word: the C++ optimizer kept the tensors it was given.
    params, tensors, loss = regression_problem()
    opt = topt.Apollo(params, lr=0.05)
    train(opt, loss, 1)
    given = opt.param_groups[0]["params"]
    opt.param_groups[0]["params"] = [torch.nn.Parameter(p.detach().clone()) for p in given]
    with pytest.raises(RuntimeError, match="no longer name the parameters"):
        opt.step()
    opt.param_groups[0]["params"] = list(given)  # the same tensors in a new list: fine
    train(opt, loss, 1)
    opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(3))]})
    opt.param_groups.pop()
    with pytest.raises(RuntimeError, match="a group removed"):
        opt.step()


def test_a_parameter_twice_in_an_added_group_is_refused_and_the_optimizer_goes_on():
    params, tensors, loss = regression_problem()
    W, b = tensors
    opt = topt.Apollo([W], lr=0.05)
    extra = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(ValueError, match="more than once"), pytest.warns(UserWarning):
        opt.add_param_group({"params": [extra, extra]})  # torch itself only warns
    assert len(opt.param_groups) == 1
    train(opt, loss, 1)


def test_a_group_added_later_is_stepped_with_the_constructors_defaults():
    params, tensors, loss = regression_problem()
    W, b = tensors
    opt = topt.Apollo([W], lr=0.05, rebound="belief")
    opt.add_param_group({"params": [b], "lr": 0.01, "rebound": "constant"})
    group = opt.param_groups[1]
    assert group["init_lr"] == pytest.approx(5e-5) and group["base_lr"] == 0.05
    assert group["weight_decay_type"] == "decoupled"
    before = b.detach().clone()
    train(opt, loss, 2)
    assert not torch.equal(before, b)
    assert sorted(opt.state_dict()["state"]) == [0, 1]


def test_a_group_whose_init_lr_lies_above_the_inherited_ramp_is_taken_as_the_reference_takes_it():
    """A group's own init_lr between the constructor's lr (its base_lr) and its own lr, or
    an own lr below the init_lr it inherits: the reference checks neither, and steps them
    (the warmup ramps down); init_lr above both lr and base_lr is refused."""
    def run(make):
        params, tensors, loss = regression_problem(torch.float64)
        W, b = tensors
        opt = make([W], lr=0.01, warmup=3)
        opt.add_param_group({"params": [b], "lr": 0.05, "init_lr": 0.025})
        opt.add_param_group({"params": [], "lr": 1e-6})  # inherits init_lr 1e-5
        train(opt, loss, 5)
        return snapshot(tensors)
    mine, theirs = run(topt.Apollo), run(ReferenceApollo)
    for a, b in zip(mine, theirs):
        assert torch.allclose(a, b, rtol=1e-12, atol=0)
    params, tensors, loss = regression_problem()
    opt = topt.Apollo([tensors[0]], lr=0.01)
    with pytest.raises(ValueError, match="init_lr"):
        opt.add_param_group({"params": [tensors[1]], "lr": 0.05, "init_lr": 0.06})


def test_a_group_frozen_at_lr_0_is_taken_as_the_reference_takes_it():
    """A group given lr 0, in the constructor's list or added later: the reference checks
    only the constructor's lr, and steps the group with the ramp it inherits during the
    warmup (the group's own lr counts after it). It was refused as an invalid lr."""
    def run(make, frozen_first=False):
        params, tensors, loss = regression_problem(torch.float64)
        W, b = tensors
        groups = [{"params": [W]}, {"params": [b], "lr": 0.0}]
        # A frozen group listed first (a frozen backbone), and an empty group: the first
        # group's options stood in for the constructor's and were refused (review finding).
        if frozen_first:
            groups = [{"params": []}, groups[1], groups[0]]
        opt = make(groups, lr=0.01, warmup=2)
        train(opt, loss, 4)
        extra = torch.linspace(-1, 1, 3, dtype=torch.float64).requires_grad_()
        opt.add_param_group({"params": [extra], "lr": 0.0})
        train(opt, lambda: loss() + (extra ** 2).sum(), 3)
        return snapshot(tensors + [extra])
    for frozen_first in (False, True):
        mine = run(topt.Apollo, frozen_first)
        theirs = run(ReferenceApollo, frozen_first)
        for a, b in zip(mine, theirs):
            assert torch.allclose(a, b, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="learning rate"):
        topt.Apollo([{"params": [torch.zeros(2, requires_grad=True)], "lr": -0.1}], lr=0.01)
    with pytest.raises(ValueError, match="learning rate"):  # the constructor's own lr
        topt.Apollo([{"params": [torch.zeros(2, requires_grad=True)], "lr": 0.1}], lr=0.0)


def test_after_a_group_is_removed_a_new_optimizer_loads_the_state_dict():
    """What the README says to do when param_groups changed under Apollo: its state_dict is
    numbered by the groups as they are now, so a new optimizer over them loads it (review
    finding: it kept the C++ optimizer's numbers, and the load refused state for a
    parameter no group lists, or took another parameter's state when shapes matched)."""
    a, b, c = (torch.randn(n, requires_grad=True) for n in (3, 3, 2))
    opt = topt.Apollo([{"params": [a]}, {"params": [b, c]}], lr=0.05, warmup=0)
    for _ in range(2):
        for p in (a, b, c):
            p.grad = torch.cos(p.detach())
        opt.step()
    del opt.param_groups[0]
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [0, 1] and sd["param_groups"][0]["params"] == [0, 1]
    fresh = topt.Apollo([{"params": [b, c]}], lr=0.05, warmup=0)
    fresh.load_state_dict(sd)
    for p, was in zip((b, c), (1, 2)):
        mine = fresh.state[p]
        assert mine["step"] == 2
        before = opt._apollo.saved_param_state(was)  # the C++ numbering: a, b, c
        assert torch.equal(mine["exp_avg_grad"], before[1])


def test_a_refused_group_is_not_added():
    params, tensors, loss = regression_problem()
    W, b = tensors
    opt = topt.Apollo([W], lr=0.05)
    with pytest.raises(ValueError, match="beta"):
        opt.add_param_group({"params": [b], "beta": 1.5})
    assert len(opt.param_groups) == 1
    train(opt, loss, 1)


def test_the_closure_runs_with_grad_and_its_loss_is_returned():
    params, tensors, loss = regression_problem()
    opt = topt.Apollo(params, lr=0.05)
    seen = []

    def closure():
        seen.append(torch.is_grad_enabled())
        opt.zero_grad()
        value = loss()
        value.backward()
        return value
    result = opt.step(closure)
    assert seen == [True] and isinstance(result, torch.Tensor) and result.item() > 0
    # Whatever the closure returns comes back as it was, as from torch.optim's step.
    assert opt.step(lambda: 1.5) == 1.5
    outputs = (loss().detach(), {"logits": None})
    assert opt.step(lambda: outputs) is outputs
    with torch.no_grad():
        assert opt.step(lambda: torch.is_grad_enabled()) is True


def test_an_exception_in_the_closure_propagates_and_changes_nothing():
    params, tensors, loss = regression_problem()
    opt = topt.Apollo(params, lr=0.05)
    twin_params, twin_tensors, twin_loss = regression_problem()
    twin = topt.Apollo(twin_params, lr=0.05)
    train(opt, loss, 2)
    train(twin, twin_loss, 2)

    def failing():
        raise KeyError("from the closure")
    with pytest.raises(KeyError, match="from the closure"):
        opt.step(failing)
    assert_bitwise(snapshot(twin_tensors), snapshot(tensors))
    train(opt, loss, 2)
    train(twin, twin_loss, 2)
    assert_bitwise(snapshot(twin_tensors), snapshot(tensors))


def test_aadl_closure_exception_propagates():
    params, tensors, loss = regression_problem()
    opt = topt.AADL(torch.optim.SGD(params, lr=0.1), history_depth=3)

    def failing():
        raise ArithmeticError("inner closure")
    with pytest.raises(ArithmeticError, match="inner closure"):
        opt.step(failing)
    # AADL's safeguard compares losses: its closure's result must be one.
    with pytest.raises(TypeError, match="closure must return a tensor, a number or None"):
        opt.step(lambda: "a string")


def test_a_safeguard_closure_that_throws_leaves_every_group_with_this_steps_store():
    # Group 0's safeguard closure throws (out of memory in a forward pass, say); group 1
    # comes after it. Before, group 1 never stored this step's iterate, and a retry did not
    # either (the counters had moved): its history lagged group 0's for good.
    torch.manual_seed(3)
    model = torch.nn.Linear(4, 3).double()
    x, y = torch.randn(16, 4, dtype=torch.float64), torch.randn(16, 3, dtype=torch.float64)
    inner = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias]}], lr=0.1)
    opt = topt.AADL(inner, history_depth=4)
    fail = [False]

    def closure():
        loss = ((model(x) - y) ** 2).mean()
        if torch.is_grad_enabled():
            inner.zero_grad()
            loss.backward()
        elif fail[0]:
            raise RuntimeError("out of memory in the forward pass")
        return loss
    for _ in range(3):
        opt.step(closure)
    assert [opt.history_size(0), opt.history_size(1)] == [3, 3]
    fail[0] = True
    with pytest.raises(RuntimeError, match="out of memory in the forward pass"):
        opt.step(closure)
    assert [opt.history_size(0), opt.history_size(1)] == [4, 4]
    bias_after_failure = model.bias.detach().clone()
    fail[0] = False
    for _ in range(2):
        opt.step(closure)
    assert [opt.history_size(0), opt.history_size(1)] == [4, 4]
    assert not torch.equal(model.bias.detach(), bias_after_failure)


def test_a_closure_the_inner_optimizer_keeps_stays_alive_with_it_and_no_longer():
    """A Python inner optimizer may keep the callable its step was given; the user's closure
    behind it must live as long as that (not dangle once the caller drops it), and be freed
    when the last holder goes."""
    import gc

    class KeepingSGD(torch.optim.SGD):
        def step(self, closure=None):
            self.kept = closure
            return super().step(closure)

    params, tensors, loss = regression_problem()
    inner = KeepingSGD(params, lr=0.1)
    opt = topt.AADL(inner, history_depth=3)

    def closure():
        opt.zero_grad()
        value = loss()
        value.backward()
        return value
    alive = weakref.ref(closure)
    expected = opt.step(closure).item()
    del closure
    gc.collect()
    assert alive() is not None and inner.kept is not None
    assert inner.kept().item() < expected  # the step moved the parameters downhill
    del inner.kept
    gc.collect()
    assert alive() is None


# ---- refusals ----------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"lr": -1.0}, "learning rate"),
    ({"lr": 0.0}, "learning rate"),
    ({"beta": 1.0}, "beta"),
    ({"eps": -1e-3}, "eps"),
    ({"warmup": -1}, "warmup"),
    ({"init_lr": 1.0}, "init_lr"),
    ({"weight_decay": -0.1}, "weight_decay"),
    ({"rebound": "elastic"}, "rebound"),
    ({"weight_decay_type": "L3"}, "weight_decay_type"),
    ({"state": "disk"}, "state='disk'"),
    ({"state_budget": 1 << 20}, "state='tiered'"),
    ({"state": "tiered", "state_budget": 0}, "positive"),
])
def test_apollo_refuses_bad_options(kwargs, match):
    params, _, _ = regression_problem()
    options = {"lr": 0.01, **kwargs}
    with pytest.raises(ValueError, match=match):
        topt.Apollo(params, **options)


class Dispatching(torch.Tensor):
    """A tensor subclass that dispatches its own operations, as DTensor does."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.as_subclass(torch.Tensor) if isinstance(t, cls) else t  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args),
                    **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


class Marked(torch.nn.Parameter):
    """A parameter subclass that dispatches nothing itself (a tag on a plain tensor)."""


def test_parameters_of_a_dispatching_subclass_are_refused_before_anything_is_made():
    params, tensors, loss = regression_problem()
    W, b = tensors
    odd = torch.Tensor._make_subclass(Dispatching, torch.zeros(3), True)
    for make in (lambda ps: topt.Apollo(ps, lr=0.01),
                 lambda ps: topt.AADL(torch.optim.SGD(ps, lr=0.1)),
                 lambda ps: topt.accelerate(torch.optim.SGD(ps, lr=0.1))):
        with pytest.raises(TypeError, match="parameter 1 is a Dispatching.*DTensor"):
            make([W, odd])
    opt = topt.Apollo([W], lr=0.01)
    with pytest.raises(TypeError, match="Dispatching"):
        opt.add_param_group({"params": [odd]})
    assert len(opt.param_groups) == 1
    train(opt, loss, 1)
    marked = Marked(torch.zeros(3))
    topt.Apollo([W, marked], lr=0.01)  # a subclass that dispatches nothing is a plain tensor


@pytest.mark.parametrize("kwargs, match", [
    ({"history_depth": 2}, "history_depth"),
    ({"relaxation": 0.0}, "relaxation"),
    ({"frequency": 0}, "frequency"),
    ({"store_each_nth": 0}, "store_each_nth"),
    ({"reg_acc": -1.0}, "reg_acc"),
    ({"acceleration_type": "broyden"}, "broyden"),
    ({"history": "gpu"}, "history='gpu'"),
    ({"history_budget": 4096}, "history='tiered'"),
])
def test_aadl_refuses_bad_options(kwargs, match):
    params, _, _ = regression_problem()
    with pytest.raises(ValueError, match=match):
        topt.AADL(torch.optim.SGD(params, lr=0.1), **kwargs)


def test_aadl_wraps_only_an_optimizer():
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        topt.AADL(object())


def test_aadl_refuses_to_step_when_the_inner_parameters_changed():
    params, tensors, loss = regression_problem()
    inner = torch.optim.SGD([tensors[0]], lr=0.1)
    opt = topt.AADL(inner, history_depth=3)
    inner.add_param_group({"params": [tensors[1]]})
    with pytest.raises(RuntimeError, match="parameters changed"):
        opt.step()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_parameters_step_in_their_dtype_in_every_placement(dtype):
    """As the reference computes: the state in the parameter's dtype, the same bits in
    each placement, and close (for that dtype) to the published algorithm's run."""
    results = []
    for where in ("device", "host", "tiered"):
        params, tensors, loss = regression_problem(dtype=dtype)
        train(topt.Apollo(params, lr=0.05, warmup=2, state=where), loss, 6)
        results.append(snapshot(tensors))
    assert_bitwise(results[0], results[1])
    assert_bitwise(results[0], results[2])
    params, tensors, loss = regression_problem(dtype=dtype)
    opt = topt.Apollo(params, lr=0.05, warmup=2)
    train(opt, loss, 1)
    assert opt.state_dict()["state"][0]["update"].dtype == dtype
    params, tensors, loss = regression_problem(dtype=dtype)
    train(ReferenceApollo(params, lr=0.05, warmup=2), loss, 6)
    ulp = torch.finfo(dtype).eps  # a few units of the dtype's last place apart at most
    for mine, theirs in zip(results[0], tensors):
        theirs = theirs.detach().double()
        assert ((mine.double() - theirs).abs() <= 8 * ulp * (1 + theirs.abs())).all()


def test_the_step_refuses_sparse_gradients_and_complex_parameters_changing_nothing():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = topt.Apollo(emb.parameters(), lr=0.05)
    emb(torch.tensor([1, 2])).sum().backward()
    before = emb.weight.detach().clone()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    assert torch.equal(before, emb.weight)

    complex_ = torch.zeros(4, dtype=torch.complex64, requires_grad=True)
    full = torch.zeros(4, requires_grad=True)
    opt = topt.Apollo([full, complex_], lr=0.05)
    full.grad, complex_.grad = torch.ones(4), torch.ones(4, dtype=torch.complex64)
    with pytest.raises(RuntimeError, match="ComplexFloat"):
        opt.step()
    assert not full.detach().any()


def forged_state_dicts(sd):
    """(name, forged copy of the Apollo state_dict sd, what the error names)."""
    def forge(change):
        copy_ = copy.deepcopy(sd)
        change(copy_)
        return copy_
    yield "not a dict", [1, 2], "not an optimizer state_dict"
    yield "groups", forge(lambda d: d["param_groups"].pop()), "parameter groups"
    yield "group size", forge(lambda d: d["param_groups"][0]["params"].append(7)), \
        "parameters"
    yield "unknown parameter", forge(lambda d: d["state"].update({9: d["state"][0]})), \
        "parameter 9"
    yield "negative step", forge(lambda d: d["state"][1].update(step=-1)), "step"
    yield "fractional step", forge(lambda d: d["state"][1].update(step=1.5)), "step"
    yield "missing key", forge(lambda d: d["state"][1].pop("update")), "update"
    yield "not a tensor", forge(lambda d: d["state"][1].update(update=[0.0])), "update"
    yield "wrong shape", forge(
        lambda d: d["state"][1].update(update=torch.zeros(5))), "shape"
    yield "integer state", forge(
        lambda d: d["state"][1].update(exp_avg_grad=torch.zeros(3, dtype=torch.int64))), \
        "floating"
    yield "bad option", forge(lambda d: d["param_groups"][1].update(beta=2.0)), "beta"
    yield "missing option", forge(lambda d: d["param_groups"][0].pop("eps")), "eps"


def test_apollo_refuses_a_bad_state_dict_and_changes_nothing():
    params, tensors, loss = regression_problem(groups=2)
    opt = topt.Apollo(params, lr=0.05, warmup=3)
    train(opt, loss, 3)
    sd = opt.state_dict()
    twin_params, twin_tensors, twin_loss = regression_problem(groups=2)
    twin = topt.Apollo(twin_params, lr=0.05, warmup=3)
    train(twin, twin_loss, 3)
    for name, forged, match in forged_state_dicts(sd):
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(forged)
        assert opt.param_groups[1]["beta"] == 0.9, name
        assert opt.state_dict()["state"][1]["step"] == 3, name
    train(opt, loss, 3)
    train(twin, twin_loss, 3)
    assert_bitwise(snapshot(twin_tensors), snapshot(tensors))


def test_aadl_refuses_a_bad_state_dict_and_changes_nothing():
    def make(params):
        return topt.AADL(torch.optim.Adam(params, lr=0.05), relaxation=0.5, history_depth=4)
    params, tensors, loss = regression_problem()
    opt = make(params)
    train(opt, loss, 4)
    good = opt.state_dict()
    twin_params, twin_tensors, twin_loss = regression_problem()
    twin = make(twin_params)
    train(twin, twin_loss, 4)
    other_params, other_tensors, other_loss = regression_problem(seed=3)
    other = make(other_params)
    train(other, other_loss, 2)  # a valid inner state, with a truncated history beside it
    truncated = {"inner": other.state_dict()["inner"], "aadl": good["aadl"][:40]}
    for forged, match in [({"inner": good["inner"]}, "not an AADL state_dict"),
                          ({"inner": good["inner"], "aadl": "text"}, "'aadl' is not a saved"),
                          ({"inner": good["inner"], "aadl": good["aadl"].float()},
                           "'aadl' is not a saved"),
                          (truncated, "AADL: the state_dict's 'aadl' is not a saved AADL")]:
        with pytest.raises(ValueError, match=match):
            opt.load_state_dict(forged)
    train(opt, loss, 4)
    train(twin, twin_loss, 4)
    assert_bitwise(snapshot(twin_tensors), snapshot(tensors))


def test_tidepool_optim_is_reached_from_the_package_without_importing_it():
    import tidepool
    assert tidepool.optim is topt


def test_a_missing_binding_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("TIDEPOOL_OPTIM_MODULE", str(tmp_path / "nothing.so"))
    with pytest.raises(_lib.LibraryError, match="TIDEPOOL_OPTIM_MODULE"):
        _lib.optim_module_path()


def test_the_device_script_runs_small_on_the_cpu():
    """scripts/optim_checks.py, which scripts/device-check runs on the GPU."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "optim_checks.py")
    result = subprocess.run([sys.executable, script, "--device", "cpu", "--layers", "2",
                             "--width", "64", "--steps", "3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "optim apollo PASS" in result.stdout and "optim aadl   PASS" in result.stdout
    assert result.stdout.count(" ms/step ") == 6
    # torch has no device peak on the CPU: said so, not printed as 0 (review finding); the
    # tiered rows' figure is their store's, on the host backend.
    assert result.stdout.count("device peak not measured (CPU)") == 4
    assert result.stdout.count("store's device peak on the host backend") == 2


# ---- the drop-in's hooks -----------------------------------------------------------------------

def test_the_step_hooks_leave_tidepool_optimizers_alone():
    from tidepool import _optim_hooks, _step_scopes
    params, _, _ = regression_problem()
    opt = topt.Apollo(params, lr=0.05)
    scopes = len(_step_scopes._scopes())
    assert _optim_hooks._pre_step(opt, (), {}) is None
    assert len(_step_scopes._scopes()) == scopes
    _optim_hooks._post_step(opt, (), {})
    assert len(_step_scopes._scopes()) == scopes
    assert not _optim_hooks._owns_state(torch.optim.SGD(params, lr=0.1))
