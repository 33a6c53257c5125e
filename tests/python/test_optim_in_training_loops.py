"""tidepool.optim where a training loop puts it, on the CPU: accelerate() (the reference's
AADL.accelerate) with LR schedulers made before or after, a wrapper installed later (HF
Accelerate's), GradScaler over a fused optimizer, and its history collected with the
optimizer; a checkpointing thread asking for a state_dict during a step.

ctest sets TIDEPOOL_OPTIM_MODULE to the built binding; without it these tests are skipped.
"""

from __future__ import annotations

import weakref

import pytest
import torch

import tidepool.optim as topt

from optim_binding import skip_without_binding
from optim_problems import assert_bitwise, regression_problem, snapshot, train

skip_without_binding()


def test_accelerate_replaces_the_optimizers_step_as_the_reference_does():
    params, tensors, loss = regression_problem()
    twin_params, twin_tensors, twin_loss = regression_problem()
    inner = torch.optim.SGD(params, lr=0.1)
    aadl = topt.accelerate(inner, relaxation=0.5, history_depth=4)
    twin = topt.AADL(torch.optim.SGD(twin_params, lr=0.1), relaxation=0.5, history_depth=4)
    train(inner, loss, 6)  # the optimizer's own step(), accelerated
    train(twin, twin_loss, 6)
    assert aadl.history_size() == 4
    assert_bitwise(snapshot(twin_tensors), snapshot(tensors))
    with pytest.raises(ValueError, match="accelerated already"):
        topt.accelerate(inner)
    del inner.step  # the plain step again
    before = snapshot(tensors)
    train(inner, loss, 1)
    assert aadl.history_size() == 4 and not torch.equal(before[0], tensors[0])


@pytest.mark.parametrize("scheduler_first", [False, True])
def test_accelerate_works_with_an_lr_scheduler_made_before_or_after(scheduler_first):
    """The scheduler sees every step (no warning), and halves the lr of the steps the
    accelerated optimizer takes, bit for bit as for an AADL around a scheduled optimizer."""
    def run(accelerated):
        params, tensors, loss = regression_problem()
        inner = torch.optim.SGD(params, lr=0.1)
        make_scheduler = lambda: torch.optim.lr_scheduler.StepLR(inner, 2, gamma=0.5)
        scheduler = make_scheduler() if scheduler_first else None
        if accelerated:
            opt = topt.accelerate(inner, relaxation=0.5, history_depth=4)
            stepper = inner
        else:
            opt = stepper = topt.AADL(inner, relaxation=0.5, history_depth=4)
        scheduler = scheduler or make_scheduler()
        for _ in range(6):
            train(stepper, loss, 1)
            scheduler.step()
        assert inner.param_groups[0]["lr"] == 0.1 / 8 and opt.history_size() == 4
        return snapshot(tensors)
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_bitwise(run(False), run(True))


def test_a_wrapper_installed_after_accelerate_wraps_the_accelerated_step():
    # Review finding: a wrapper that does not name what it wraps (no __wrapped__, as HF
    # Accelerate's patch_optimizer_step) made the inner step call the wrapper again, which
    # called the accelerated step, without end.
    params, tensors, loss = regression_problem()
    twin_params, twin_tensors, twin_loss = regression_problem()
    inner = torch.optim.SGD(params, lr=0.1)
    topt.accelerate(inner, relaxation=0.5, history_depth=4)
    twin = topt.AADL(torch.optim.SGD(twin_params, lr=0.1), relaxation=0.5, history_depth=4)
    accelerated, calls = inner.step, []

    def wrapper(*args, **kwargs):
        calls.append(1)
        return accelerated(*args, **kwargs)
    inner.step = wrapper
    train(inner, loss, 6)
    train(twin, twin_loss, 6)
    assert len(calls) == 6
    assert_bitwise(snapshot(twin_tensors), snapshot(tensors))


def test_an_accelerated_fused_optimizer_skips_the_steps_grad_scaler_finds_overflowing():
    # Review finding: GradScaler steps an optimizer that unscales itself (fused Adam) also
    # on overflow, with found_inf set; the inner step skipped, but AADL stored the same
    # iterate again and extrapolated.
    params, tensors, loss = regression_problem()
    inner = torch.optim.Adam(params, lr=0.01, fused=True)
    aadl = topt.accelerate(inner, relaxation=0.5, history_depth=4)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    for _ in range(3):
        inner.zero_grad()
        scaler.scale(loss()).backward()
        scaler.step(inner)
        scaler.update()
    before, stored = snapshot(tensors), aadl.history_size()
    inner.zero_grad()
    scaler.scale(loss()).backward()
    tensors[0].grad[0, 0] = float("inf")
    scaler.step(inner)
    scaler.update()
    assert_bitwise(before, snapshot(tensors))
    assert aadl.history_size() == stored
    assert scaler.get_scale() == 2.0  # the overflow was seen
    inner.zero_grad()
    scaler.scale(loss()).backward()
    scaler.step(inner)  # and the next step is accelerated again
    assert aadl.history_size() == min(stored + 1, 4)


@pytest.mark.parametrize("which", ["apollo", "aadl"])
def test_a_state_dict_asked_for_during_a_step_waits_for_it(which):
    # Note [one call at a time] (review finding): a background thread checkpointing
    # during a step raced the C++ state the step held (their calls let go of the GIL).
    # Asked while the step runs its closure, the state_dict must be the step's result.
    import threading
    import time
    params, tensors, loss = regression_problem()
    opt = (topt.Apollo(params, lr=0.05) if which == "apollo"
           else topt.AADL(torch.optim.SGD(params, lr=0.1), history_depth=3))
    train(opt, loss, 2)
    taken, started = [], threading.Event()
    thread = threading.Thread(target=lambda: (started.wait(), taken.append(opt.state_dict())))
    thread.start()

    def closure():  # AADL's safeguard calls it again, without grad
        value = loss()
        if torch.is_grad_enabled():
            opt.zero_grad()
            value.backward()
        if not started.is_set():
            started.set()
            time.sleep(0.3)  # the checkpoint thread asks now
        return value
    opt.step(closure)
    thread.join()
    after = opt.state_dict()
    if which == "apollo":
        assert [s["step"] for s in taken[0]["state"].values()] == [3, 3]
        for key in ("exp_avg_grad", "approx_hessian", "update"):
            assert all(torch.equal(taken[0]["state"][i][key], after["state"][i][key])
                       for i in after["state"])
    else:
        assert torch.equal(taken[0]["aadl"], after["aadl"])


def test_an_accelerated_optimizer_is_collected_with_its_history():
    import gc
    params, tensors, loss = regression_problem()
    inner = torch.optim.SGD(params, lr=0.1)
    topt.accelerate(inner, history_depth=3)
    train(inner, loss, 3)
    gone = weakref.ref(inner)
    del inner
    gc.collect()
    assert gone() is None
