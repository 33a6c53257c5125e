"""The step hooks' scopes and moves where a step is reached past the usual path, on a
machine without a GPU (fake_torch_cuda.py and fake_tiering.py record what the hooks do):
an LR scheduler made before the install, whose instance wrapper of optimizer.step calls
the step() the class had then (Note [a step that raises]); ZeroRedundancyOptimizer's
load_state_dict, which puts the state in its local optimizer itself (Note [loaded
state]); a state step nested in a workspace step in pool mode (Note [only state steps
enter the pool]); and a scope that cannot open again after the closure (Note
[closures])."""

from __future__ import annotations

import copy

import pytest
import torch

from tidepool import _in_flight, _install, _step_scopes, _tags

from fake_tiering import EVICT, fake_tiering, prefetch_of, untiered_state  # noqa: F401
from fake_torch_cuda import fake_cuda, install  # noqa: F401  (a fixture, and the install)
from test_optim_hooks import fake_process_group, pool_mode_sgd_with_state  # noqa: F401  (a fixture)


def raising_closure():
    raise RuntimeError("boom")


def pools_entered(fake_cuda) -> int:
    """How many tidepool MemPools the thread is in now (fake_cuda's record)."""
    return sum({"enter_pool": 1, "exit_pool": -1}.get(c[0], 0) for c in fake_cuda)


def test_a_step_through_a_scheduler_made_before_the_install_is_guarded(fake_cuda,
                                                                       fake_tiering):
    class EarlySGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    optimizer = EarlySGD([p], lr=0.1, momentum=0.9)  # torch wraps EarlySGD.step now
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    scheduled = vars(optimizer)["step"]  # the scheduler's wrapper, on the instance
    install(state_budget="1GiB")
    outside = _tags.current()
    p.grad = torch.ones(2)
    optimizer.step()  # state to prefetch
    scheduler.step()
    fake_tiering.clear()
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step(raising_closure)
    # Closed by the guard, and the state prefetched for the step evicted.
    assert _tags.current() == outside
    assert _step_scopes._scopes() == [] and _in_flight.in_flight() == {}
    assert fake_tiering == [prefetch_of(optimizer), EVICT]
    # Another optimizer's steps go on evicting (a scope left open would hold the device).
    q = torch.nn.Parameter(torch.ones(3))
    other = torch.optim.SGD([q], lr=0.1, momentum=0.9)
    fake_tiering.clear()
    q.grad = torch.ones(3)
    other.step()
    assert fake_tiering == [EVICT]
    # The scheduler still sees the steps, and removal puts its wrapper's step back.
    assert optimizer._opt_called and scheduler.get_last_lr() == [0.05]
    for handle in _install.STATE.optimizer_hooks:
        handle.remove()
    _install.STATE.optimizer_hooks = None
    assert vars(optimizer)["step"] is scheduled
    assert not any(getattr(cell.cell_contents, "tidepool_guarded", False)
                   for cell in scheduled.__closure__)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, which ZeRO imports
def test_zero_redundancy_optimizers_loaded_local_state_is_taken_in(
        fake_cuda, fake_tiering, untiered_state, fake_process_group):
    # ZeRO's load_state_dict puts this rank's state into its local optimizer itself; the
    # copy Optimizer.load_state_dict then loads into ZeRO's own state no step reads.
    from torch.distributed.optim import ZeroRedundancyOptimizer
    install(tier_min_bytes="64")
    torch.manual_seed(0)
    grads = [[torch.randn(32) for _ in range(4)] for _ in range(4)]

    def model():
        return [torch.nn.Parameter(torch.linspace(-1, 1, 32) * (i + 1)) for i in range(4)]

    def train(zero, params, steps):
        for step_grads in steps:
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            zero.step()

    params = model()
    zero = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-2)
    train(zero, params, grads[:2])
    # What zero.state_dict() gives after consolidate_state_dict() (which the fake process
    # group cannot run): every rank's local state under the parameters' global indices,
    # here only this rank's.
    saved = torch.optim.Optimizer.state_dict(zero)  # ZeRO's groups
    saved["state"] = {zero._param_to_index[p]: state for p, state in zero.optim.state.items()}
    checkpoint = {"params": [p.detach().clone() for p in params],
                  "optimizer": copy.deepcopy(saved)}
    train(zero, params, grads[2:])
    uninterrupted = [p.detach().clone() for p in params]

    resumed = model()
    with torch.no_grad():
        for p, value in zip(resumed, checkpoint["params"]):
            p.copy_(value)
    zero = ZeroRedundancyOptimizer(resumed, optimizer_class=torch.optim.AdamW, lr=1e-2)
    untiered_state.adopted_under.clear()
    fake_tiering.clear()
    zero.load_state_dict(copy.deepcopy(checkpoint["optimizer"]))
    local = zero.optim.state
    assert len(local) == 2  # this rank's half of the parameters
    for p, state in local.items():
        for k in ("exp_avg", "exp_avg_sq"):
            # The state the steps use is tiered; ZeRO's own copy is not left on the
            # device either, and (loaded here from tensors already on the parameters'
            # device, so the two copies are the same tensors) the two still share it.
            assert untiered_state.tiered(state[k])
            assert zero.state[p][k].data_ptr() == state[k].data_ptr()
    assert untiered_state.adopted_under == [_tags.OPTIMIZER_STATE] * 4
    assert fake_tiering == [EVICT]
    train(zero, resumed, grads[2:])
    local_params = [p for group in zero.optim.param_groups for p in group["params"]]
    for p, expected in zip(resumed, uninterrupted):
        if any(p is q for q in local_params):  # the other rank's shard is not stepped here
            assert torch.equal(p.detach(), expected), "resuming changes no bit"


def test_a_state_step_inside_a_workspace_step_allocates_in_tidepools_pool(fake_cuda,
                                                                          fake_tiering):
    # Note [only state steps enter the pool]: the enclosing workspace step entered none.
    install(mode="pool")

    class Inner(torch.optim.SGD):
        seen: list = []

        def step(self, closure=None):
            Inner.seen.append((_tags.current(), pools_entered(fake_cuda)))
            return super().step(closure)

    class Lookahead(torch.optim.SGD):  # a wrapper whose step runs another optimizer's
        def __init__(self, params):
            super().__init__(params, lr=0.0)
            self.inner = None

        def step(self, closure=None):
            if self.inner is not None:
                self.inner.step()
            return super().step(closure)

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    outer = Lookahead([a])
    a.grad = torch.ones(2)
    outer.step()  # leaves `a` stateless: the outer's steps are workspace ones from now on
    outer.inner = Inner([b], lr=0.1, momentum=0.9)
    b.grad = torch.ones(3)
    outside = _tags.current()
    fake_cuda.clear()
    fake_tiering.clear()
    outer.step()  # the inner optimizer's first step, which makes its state
    assert Inner.seen == [(_tags.OPTIMIZER_STATE, 1)]
    assert [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")] == [
        ("enter_pool", 0), ("exit_pool", 0)]
    assert _tags.current() == outside
    assert fake_tiering == [EVICT]  # once, after the outermost step


def test_a_scope_that_cannot_open_again_after_the_closure_evicts_the_state(
        fake_cuda, fake_tiering, monkeypatch):
    # Note [closures]: the guard finds no scope of the step to close then.
    p, optimizer = pool_mode_sgd_with_state()
    q = torch.nn.Parameter(torch.ones(3))
    optimizer.add_param_group({"params": [q]})
    optimizer.zero_grad()  # no gradient before the closure: a workspace scope, no pool

    def closure():
        # Its gradients make the scope after it a state one, whose pool lease fails.
        monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda pool, device=None: 1 / 0)
        p.grad, q.grad = torch.ones(2), torch.ones(3)
        return 0.0

    outside = _tags.current()
    prefetch = prefetch_of(optimizer)
    fake_tiering.clear()
    with pytest.raises(ZeroDivisionError):
        optimizer.step(closure)
    assert fake_tiering == [prefetch, EVICT]
    assert _tags.current() == outside
    assert _step_scopes._scopes() == [] and _in_flight.in_flight() == {}


def test_a_scope_that_fails_to_close_before_the_closure_still_counts_the_step_out(
        fake_cuda, fake_tiering, monkeypatch):
    # Review finding: the scope was taken off before its closing raised, so neither the
    # closure wrapper nor the guard counted the step out: in flight on its device for
    # good, which stopped every later eviction there.
    p, optimizer = pool_mode_sgd_with_state()

    real_exit_all = _install.exit_all
    failed = []

    def failing_exit(contexts):
        real_exit_all(contexts)  # exited, then said to have failed: once
        if not failed:
            failed.append(True)
            raise RuntimeError("the MemPool would not exit")

    def closure():
        return 0.0

    monkeypatch.setattr(_install, "exit_all", failing_exit)
    outside = _tags.current()
    prefetch = prefetch_of(optimizer)
    fake_tiering.clear()
    with pytest.raises(RuntimeError, match="would not exit"):
        optimizer.step(closure)
    assert fake_tiering == [prefetch, EVICT]
    assert _tags.current() == outside
    assert _step_scopes._scopes() == [] and _in_flight.in_flight() == {}
