"""tidepool.optim.Apollo's `state` (Note [Apollo's state as torch.optim shows it]), on
the CPU: it shows the C++ optimizer's state as torch.optim keys it, read-only, and a
parameter that has not stepped as step 0 and zeros, so torch.distributed.checkpoint's
get/set_optimizer_state_dict never take their zero-gradient step on it (they did at every
checkpoint after zero_grad, and moved a fresh optimizer's parameters); DCP's save -> load
-> continue equals an uninterrupted run, and a fresh optimizer's state_dict loads into one
that then steps as a fresh one does (here and in the published Apollo).

ctest sets TIDEPOOL_OPTIM_MODULE to the built binding; without it these tests are skipped.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_optimizer_state_dict,
                                                     get_state_dict, set_state_dict)

import tidepool.optim as topt

from optim_binding import skip_without_binding
from optim_problems import assert_bitwise, regression_problem, snapshot, train
from reference_apollo import ReferenceApollo

skip_without_binding()

STATE_KEYS = ("exp_avg_grad", "approx_hessian", "update")


def model_with_data(weights_seed=0):
    torch.manual_seed(weights_seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(32, 6, generator=gen), torch.randn(32, 2, generator=gen)
    return model, lambda: ((model(x) - y) ** 2).mean()


def test_state_shows_each_parameters_state_read_only():
    params, tensors, loss = regression_problem(groups=2)
    frozen = torch.zeros(4)  # no grad: not shown until it has state, as torch.optim's dict
    opt = topt.Apollo(params + [{"params": [frozen]}], lr=0.05, warmup=3)
    assert len(opt.state) == 2 and list(opt.state) == tensors
    assert tensors[0] in opt.state and frozen not in opt.state
    for t in tensors:  # not stepped yet: the state its first step starts from
        entry = opt.state[t]
        assert entry["step"] == 0 and all(not entry[k].any() for k in STATE_KEYS)
        assert all(entry[k].shape == t.shape for k in STATE_KEYS)
    train(opt, loss, 2)
    saved = opt.state_dict()["state"]
    for index, (p, entry) in enumerate(opt.state.items()):
        assert p is tensors[index] and entry["step"] == 2
        assert all(torch.equal(entry[k], saved[index][k]) for k in STATE_KEYS)
    with pytest.raises(KeyError, match="not a parameter of this optimizer"):
        opt.state[torch.zeros(3)]
    for change in (lambda: opt.state.__setitem__(tensors[0], {}),
                   lambda: opt.state.__delitem__(tensors[0]), opt.state.clear,
                   lambda: setattr(opt, "state", {})):
        with pytest.raises(TypeError, match="state"):
            change()
    with pytest.raises(TypeError):
        opt.state[tensors[0]]["step"] = 7
    assert opt.state[tensors[0]]["step"] == 2  # nothing changed


def test_items_and_values_read_the_parameter_list_once():
    params = [torch.randn(3, requires_grad=True) for _ in range(20)]
    opt = topt.Apollo(params, lr=0.05)

    class Counting:  # the C++ optimizer, counting the walks of its parameter list
        def __init__(self, inner):
            self.inner, self.walks = inner, 0

        def parameters_with_state(self):
            self.walks += 1
            return self.inner.parameters_with_state()

        def __getattr__(self, name):
            return getattr(self.inner, name)

    counting = Counting(opt._apollo)
    opt._apollo = counting
    try:
        assert [p for p, _ in opt.state.items()] == params
        assert counting.walks == 1, "items() walked the parameters once per key"
        assert sum(1 for _ in opt.state.values()) == 20
        assert counting.walks == 2, "values() walked the parameters once per key"
        assert all(entry["step"] == 0 for entry in opt.state.values())
    finally:
        opt._apollo = counting.inner


def test_dcp_get_optimizer_state_dict_takes_no_step_after_zero_grad():
    """Review finding: with `state` always empty, DCP stepped Apollo (zero gradients, lr
    0) at every call after zero_grad: the step count and m, B, d moved each time."""
    model, loss = model_with_data()
    opt = topt.Apollo(model.parameters(), lr=0.05, warmup=2)
    train(opt, loss, 3)
    opt.zero_grad(set_to_none=True)  # where a training loop takes its checkpoints
    before, params = opt.state_dict()["state"], snapshot(model.parameters())
    for _ in range(2):
        got = get_optimizer_state_dict(model, opt)
    after = opt.state_dict()["state"]
    for index, entry in before.items():
        assert after[index]["step"] == entry["step"] == 3
        assert all(torch.equal(after[index][k], entry[k]) for k in STATE_KEYS)
    assert_bitwise(params, snapshot(model.parameters()))
    assert sorted(got["state"]) == sorted(name for name, _ in model.named_parameters())


@pytest.mark.parametrize("decay", ["L2", "decoupled", "stable"])
def test_dcp_leaves_a_fresh_optimizers_parameters_alone(decay):
    """DCP's zero-gradient step on a fresh optimizer moved the parameters: in the warmup
    the lr is the ramp's, not the group's (which DCP sets to 0), and weight decay acts."""
    model, _ = model_with_data()
    opt = topt.Apollo(model.parameters(), lr=0.05, warmup=5, weight_decay=0.1,
                      weight_decay_type=decay)
    params = snapshot(model.parameters())
    got = get_optimizer_state_dict(model, opt)
    assert_bitwise(params, snapshot(model.parameters()))
    assert all(entry["step"] == 0 for entry in got["state"].values())
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("where", ["device", "tiered"])
def test_dcp_save_load_continue_equals_an_uninterrupted_run(where, tmp_path):
    model, loss = model_with_data()
    straight = topt.Apollo(model.parameters(), lr=0.05, warmup=3, weight_decay=0.01,
                           state=where)
    train(straight, loss, 8)
    expected = snapshot(model.parameters())

    model, loss = model_with_data()
    first = topt.Apollo(model.parameters(), lr=0.05, warmup=3, weight_decay=0.01,
                        state=where)
    train(first, loss, 4)
    first.zero_grad(set_to_none=True)
    model_sd, optim_sd = get_state_dict(model, first)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp_path))

    model, loss = model_with_data(weights_seed=5)  # other weights: the checkpoint's come back
    resumed = topt.Apollo(model.parameters(), lr=0.9, warmup=2, weight_decay=0.5,
                          state=where)
    model_sd, optim_sd = get_state_dict(model, resumed)
    assert all(p.grad is None for p in model.parameters())  # and no step was taken
    target = {"model": model_sd, "optim": optim_sd}
    dcp.load(target, checkpoint_id=str(tmp_path))
    set_state_dict(model, resumed, model_state_dict=target["model"],
                   optim_state_dict=target["optim"])
    assert resumed.param_groups[0]["lr"] == 0.05
    assert all(entry["step"] == 4 for entry in resumed.state.values())
    train(resumed, loss, 4)
    assert_bitwise(expected, snapshot(model.parameters()))


@pytest.mark.parametrize("then", [topt.Apollo, ReferenceApollo],
                         ids=["tidepool", "reference"])
def test_a_fresh_optimizers_state_dict_loads_as_a_fresh_start(then):
    """Step 0 and zeros is the state the first step starts from, here and in the
    published Apollo."""
    params, tensors, loss = regression_problem()
    plain = then(params, lr=0.05, warmup=3, weight_decay=0.1)
    train(plain, loss, 3)
    expected = snapshot(tensors)

    params, tensors, loss = regression_problem()
    saved = topt.Apollo(params, lr=0.05, warmup=3, weight_decay=0.1).state_dict()
    loaded = then(params, lr=0.05, warmup=3, weight_decay=0.1)
    loaded.load_state_dict(saved)
    train(loaded, loss, 3)
    assert_bitwise(expected, snapshot(tensors))
