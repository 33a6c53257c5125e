"""The global optimizer step hooks inside torch, on a machine without a GPU (torch's CUDA
entry points and the tiering C ABI are recorders, fake_torch_cuda.py and fake_tiering.py;
tags go through the real libtidepool):
each step runs tagged between prefetch and evict, the prefetch is the stepped
optimizer's own state by pointer (Note [prefetch by pointer]), a parameter a step left
stateless does not make later steps optimizer_state ones until its group's
hyperparameters may turn state on (Note [step tags]), and the bookkeeping of that keeps
no optimizer alive; the closure of step(closure) runs
outside the step's scope and the state is still tagged (Note [closures]), a step or hook
that raises closes its scope (Note [a step that raises]), nested steps keep the outer
scope, loaded state (plain tensors and DTensor shards) is taken into tiering
(Note [loaded state]), the patches come off cleanly, and the update itself is torch's,
bit for bit, compiled or not."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch

from tidepool import (_adoption, _in_flight, _install, _state_tensors, _step_tags, _tags,
                      _tiering)

from fake_tiering import EVICT, fake_tiering, prefetch_of, untiered_state  # noqa: F401  (fixtures)
from fake_torch_cuda import fake_cuda, install  # noqa: F401  (a fixture, and the install)


class RecordingSGD(torch.optim.SGD):
    """SGD that notes the allocation tag in force while its step runs."""

    seen_tags: list

    def step(self, closure=None):
        type(self).seen_tags.append(_tags.current())
        return super().step(closure)


original_cuda_index = _state_tensors._cuda_index


@pytest.mark.parametrize("mode", ["global", "pool"])
def test_each_step_runs_tagged_between_prefetch_and_evict(fake_cuda, fake_tiering, mode):
    install(mode=mode, state_budget="1GiB")
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = RecordingSGD([p], lr=0.5, momentum=0.9)
    RecordingSGD.seen_tags = []
    outside = _tags.current()
    for _ in range(2):
        p.grad = torch.ones(4)
        optimizer.step()
    # The first step creates the momentum buffers; the second only has temporaries.
    assert RecordingSGD.seen_tags == [_tags.OPTIMIZER_STATE, _tags.WORKSPACE]
    assert _tags.current() == outside
    # Before the first step there is no state to prefetch; before the second, the buffer.
    assert fake_tiering == [EVICT, prefetch_of(optimizer), EVICT]
    assert fake_tiering[1][2] == (optimizer.state[p]["momentum_buffer"].data_ptr(),)
    # In pool mode only the first step's allocations go to tidepool's MemPool: the
    # second's temporaries are PyTorch's (Note [only state steps enter the pool]).
    pool_events = [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")]
    assert pool_events == ([("enter_pool", 0), ("exit_pool", 0)] if mode == "pool" else [])
    # The update itself is SGD's, untouched: two momentum steps of 0.5 * (1, 1.9).
    assert torch.allclose(p.detach(), torch.full((4,), 1 - 0.5 - 0.95))


def test_parameters_added_later_get_their_state_tagged(fake_cuda, fake_tiering):
    install()
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    optimizer = RecordingSGD([a], lr=0.1, momentum=0.9)
    RecordingSGD.seen_tags = []
    a.grad = torch.ones(2)
    optimizer.step()
    optimizer.step()
    optimizer.add_param_group({"params": [b]})
    b.grad = torch.ones(3)
    optimizer.step()
    assert RecordingSGD.seen_tags == [_tags.OPTIMIZER_STATE, _tags.WORKSPACE, _tags.OPTIMIZER_STATE]


def test_with_two_optimizers_each_step_prefetches_only_its_own_state(fake_cuda, fake_tiering):
    # Note [prefetch by pointer]: a GAN's generator and discriminator, stepped in turn. A
    # prefetch of the whole tag would bring the other's state in too.
    install(state_budget="1GiB")
    g1, g2 = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(2, 3))
    d1 = torch.nn.Parameter(torch.ones(5))
    # Two groups, the second parameter's first: the prefetch follows param_groups.
    generator = torch.optim.AdamW([{"params": [g2]}, {"params": [g1], "lr": 1e-2}])
    discriminator = torch.optim.SGD([d1], lr=0.1, momentum=0.9)
    for _ in range(3):
        fake_tiering.clear()
        g1.grad, g2.grad = torch.ones(4), torch.ones(2, 3)
        generator.step()
        d1.grad = torch.ones(5)
        discriminator.step()
    state = generator.state
    own = tuple(state[p][k].data_ptr() for p in (g2, g1) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert fake_tiering == [("prefetch", 0, own, 4242), EVICT,
                            ("prefetch", 0,
                             (discriminator.state[d1]["momentum_buffer"].data_ptr(),), 4242),
                            EVICT]


def test_a_subclass_step_calling_its_bases_prefetches_once(fake_cuda, fake_tiering):
    # torch hooks both classes' step(): the nested one is the same optimizer's, whose
    # state the enclosing pre-hook brought already.
    install(state_budget="1GiB")

    class Base(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    class Derived(Base):
        def step(self, closure=None):
            return super().step(closure)

    Base([torch.nn.Parameter(torch.ones(1))], lr=0.1)  # torch wraps Base.step now
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = Derived([p], lr=0.1, momentum=0.9)
    assert Base.step.tidepool_guarded and Derived.step.tidepool_guarded
    for _ in range(2):
        p.grad = torch.ones(2)
        optimizer.step()
    assert fake_tiering == [EVICT, prefetch_of(optimizer), EVICT]


def test_the_prefetch_names_the_state_tensors_on_cuda_in_the_order_the_step_uses_them(
        fake_cuda, fake_tiering, monkeypatch):
    class Custom(torch.optim.Optimizer):  # state of every shape an optimizer may keep
        def __init__(self, params):
            super().__init__(params, {})

    a, b, frozen = (torch.nn.Parameter(torch.ones(n)) for n in (2, 3, 4))
    optimizer = Custom([{"params": [b, frozen]}, {"params": [a]}])
    a.grad, b.grad = torch.ones(2), torch.ones(3)  # frozen has none: the step skips it
    ta, tb, tf, h1, h2, shared = (torch.ones(4) for _ in range(6))
    view = tb[1:]  # a view: a pointer inside tb's range (the C side moves that range once)
    optimizer.state[a] = {"buf": ta, "step": torch.tensor(3.0), "count": 7, "history": [h1, (h2,)]}
    optimizer.state[b] = {"buf": tb, "view": view}
    optimizer.state[frozen] = {"buf": tf}
    optimizer.state["own key"] = {"table": shared}
    optimizer.state[torch.nn.Parameter(torch.ones(1))]  # an empty entry (defaultdict)
    install()
    # Multi-element tensors stand in for CUDA ones; the 0-d step counter for one on the CPU.
    monkeypatch.setattr(_state_tensors, "_cuda_index", lambda t: 1 if t.dim() > 0 else -1)
    used = [tb.data_ptr(), view.data_ptr(), ta.data_ptr(), h1.data_ptr(), h2.data_ptr()]
    assert _state_tensors._state_pointers(optimizer, every_parameter=False) == {
        1: used + [shared.data_ptr()]}
    # With a closure the gradients come later: every parameter's state is named.
    assert _state_tensors._state_pointers(optimizer, every_parameter=True) == {
        1: used[:2] + [tf.data_ptr()] + used[2:] + [shared.data_ptr()]}
    monkeypatch.setattr(_state_tensors, "_cuda_index", original_cuda_index)
    # On this machine: all on the CPU.
    assert _state_tensors._state_pointers(optimizer, every_parameter=True) == {}


def test_a_parameter_a_step_left_stateless_does_not_make_later_steps_state_steps(
        fake_cuda, fake_tiering):
    # Note [step tags]: SGD without momentum never creates state; its steps after the
    # first need no pointer-stable ranges for their temporaries.
    install(state_budget="1GiB")
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    optimizer = RecordingSGD([a], lr=0.1)
    RecordingSGD.seen_tags = []
    for _ in range(3):
        a.grad = torch.ones(2)
        optimizer.step()
    assert RecordingSGD.seen_tags == [_tags.OPTIMIZER_STATE] + [_tags.WORKSPACE] * 2
    assert fake_tiering == [EVICT] * 3  # no state: nothing to prefetch
    # A parameter added later is new: its first step may create state.
    optimizer.add_param_group({"params": [b]})
    b.grad = torch.ones(3)
    optimizer.step()
    optimizer.step()
    assert RecordingSGD.seen_tags[3:] == [_tags.OPTIMIZER_STATE, _tags.WORKSPACE]
    # A reload forgets them: the loaded groups turn momentum on, and the next step
    # creates the buffers, under optimizer_state.
    reloaded = optimizer.state_dict()
    for group in reloaded["param_groups"]:
        group["momentum"] = 0.9
    optimizer.load_state_dict(reloaded)
    optimizer.step()
    optimizer.step()
    assert RecordingSGD.seen_tags[5:] == [_tags.OPTIMIZER_STATE, _tags.WORKSPACE]
    assert all("momentum_buffer" in optimizer.state[p] for p in (a, b))
    # State cleared: the parameters that had it are new again.
    optimizer.state.clear()
    optimizer.step()
    assert RecordingSGD.seen_tags[7:] == [_tags.OPTIMIZER_STATE]


def test_a_parameter_that_had_no_gradient_is_not_taken_for_stateless(fake_cuda, fake_tiering):
    install()
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    optimizer = RecordingSGD([a, b], lr=0.1, momentum=0.9)
    RecordingSGD.seen_tags = []
    a.grad = torch.ones(2)
    optimizer.step()  # b, without a gradient, was not stepped: it is not stateless
    b.grad = torch.ones(3)
    optimizer.step()
    assert RecordingSGD.seen_tags == [_tags.OPTIMIZER_STATE] * 2
    assert "momentum_buffer" in optimizer.state[b]


def test_raising_momentum_by_hand_gets_the_buffers_the_next_step_makes_tagged(
        fake_cuda, fake_tiering):
    # Note [step tags]: the parameters a step left stateless count again once their
    # group's hyperparameters may turn state on; lr, which a scheduler changes every
    # step, does not make them count.
    install()
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    optimizer = RecordingSGD([{"params": [a]}, {"params": [b]}], lr=0.1)
    RecordingSGD.seen_tags = []
    for step in range(3):
        a.grad, b.grad = torch.ones(2), torch.ones(3)
        for group in optimizer.param_groups:
            group["lr"] = 0.1 / (step + 1)
        optimizer.step()
    assert RecordingSGD.seen_tags == [_tags.OPTIMIZER_STATE] + [_tags.WORKSPACE] * 2
    optimizer.param_groups[1]["momentum"] = 0.9  # b's group only
    optimizer.step()
    optimizer.step()
    assert RecordingSGD.seen_tags[3:] == [_tags.OPTIMIZER_STATE, _tags.WORKSPACE]
    assert "momentum_buffer" in optimizer.state[b] and not optimizer.state.get(a)


def test_remembering_stateless_parameters_keeps_no_optimizer_or_parameter_alive(
        fake_cuda, fake_tiering):
    install()
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([p], lr=0.1)
    p.grad = torch.ones(2)
    optimizer.step()
    assert optimizer in _step_tags._stateless  # remembered ...
    optimizer_ref, parameter_ref = weakref.ref(optimizer), weakref.ref(p)
    del optimizer, p
    gc.collect()
    assert optimizer_ref() is None and parameter_ref() is None  # ... but not kept


def test_with_no_state_budget_nothing_is_prefetched(fake_cuda, fake_tiering):
    # Note [state budget 0] in _state_moves.py: the state stays on the host.
    install()
    p = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.AdamW([p])
    for _ in range(2):
        p.grad = torch.ones(4)
        optimizer.step()
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)] * 2


def raising_closure():
    raise RuntimeError("boom")


class StateTagAdam(torch.optim.Adam):
    """Adam that notes the allocation tag in force when it creates state."""

    seen_tags: list

    def _init_group(self, group, *args):
        if any(p.grad is not None and not self.state.get(p) for p in group["params"]):
            type(self).seen_tags.append(_tags.current())
        return super()._init_group(group, *args)


@pytest.mark.parametrize("mode", ["global", "pool"])
@pytest.mark.parametrize("pass_closure", ["positional", "keyword"])
def test_a_closure_runs_outside_the_step_and_its_gradients_decide_the_tag(
        fake_cuda, fake_tiering, mode, pass_closure):
    # Note [closures]: the usual closure zeroes the gradients and makes them anew, so
    # before it runs there is no gradient to say that the step will create state.
    install(mode=mode, state_budget="1GiB")
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = StateTagAdam([p], lr=0.1)
    StateTagAdam.seen_tags = []
    outside = _tags.current()
    in_closure = []

    def closure():
        pools_entered = sum({"enter_pool": 1, "exit_pool": -1}.get(c[0], 0) for c in fake_cuda)
        in_closure.append((_tags.current(), pools_entered))
        optimizer.zero_grad()
        loss = (p * p).sum()
        loss.backward()
        return loss

    for _ in range(2):
        loss = optimizer.step(closure) if pass_closure == "positional" else \
            optimizer.step(closure=closure)
        assert loss.item() == pytest.approx((p.detach() * p.detach()).sum().item(), rel=0.5)
    # The closure allocated as the caller does (outside's tag, no pool entered) ...
    assert in_closure == [(outside, 0)] * 2
    # ... and the state Adam then created is tagged as state, not workspace.
    assert StateTagAdam.seen_tags == [_tags.OPTIMIZER_STATE]
    assert _tags.current() == outside
    assert fake_tiering == [EVICT, prefetch_of(optimizer), EVICT]
    # The update is Adam's: the same as without the hooks.
    for handle in _install.STATE.optimizer_hooks:
        handle.remove()
    _install.STATE.optimizer_hooks = None
    q = torch.nn.Parameter(torch.ones(3))
    plain = torch.optim.Adam([q], lr=0.1)

    def plain_closure():
        plain.zero_grad()
        loss = (q * q).sum()
        loss.backward()
        return loss

    for _ in range(2):
        plain.step(plain_closure)
    assert torch.equal(p.detach(), q.detach())


class ModelStepped(torch.optim.SGD):
    """A custom optimizer whose step takes the model (an nn.Module: callable) first."""

    def step(self, model=None):
        self.seen = model
        return super().step()


def test_a_callable_first_argument_of_a_step_without_a_closure_is_left_alone(
        fake_cuda, fake_tiering):
    """Review finding: any callable first argument was wrapped as step()'s closure, so a
    step(self, model) got a function in place of its nn.Module."""
    install(state_budget="1GiB")
    model = torch.nn.Linear(3, 1)
    optimizer = ModelStepped(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step(model)
    assert optimizer.seen is model
    closure_optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen_tags = []
    closure_optimizer.step(lambda: seen_tags.append(_tags.current()))
    assert seen_tags == [_tags.current()]  # a closure is still run outside the scope


def test_a_closure_called_several_times_runs_outside_the_step_each_time(fake_cuda, fake_tiering):
    install(mode="pool", state_budget="1GiB")
    p = torch.nn.Parameter(torch.tensor([3.0, -2.0]))
    optimizer = torch.optim.LBFGS([p], lr=0.5, max_iter=4)
    outside = _tags.current()
    in_closure = []

    def closure():
        in_closure.append(_tags.current())
        optimizer.zero_grad()
        loss = ((p - 1.0) ** 2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    assert len(in_closure) > 1
    assert set(in_closure) == {outside}
    assert _tags.current() == outside
    # LBFGS puts its parameter's entry in optimizer.state before it first calls the
    # closure, so each time the scope opens (at the pre-hook and after every call) the
    # step counts as one that makes no state: a workspace step, which enters no pool
    # (Note [only state steps enter the pool] in _step_scopes.py).
    pool_events = [c[0] for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")]
    assert pool_events == []


@pytest.mark.parametrize("mode", ["global", "pool"])
def test_a_step_that_raises_closes_its_scope_and_evicts(fake_cuda, fake_tiering, mode):
    # Note [a step that raises]: torch runs no post-hook then; the guard does its work.
    install(mode=mode, state_budget="1GiB")

    class FreshAdamW(torch.optim.AdamW):  # a step() torch wraps only now, with the guard
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    optimizer = FreshAdamW([p])
    assert FreshAdamW.step.tidepool_guarded
    outside = _tags.current()
    p.grad = torch.ones(2)
    optimizer.step()  # state to prefetch
    # A parameter without state makes the next steps state steps, which enter the pool
    # (Note [only state steps enter the pool] in _step_scopes.py).
    q = torch.nn.Parameter(torch.ones(3))
    q.grad = torch.ones(3)
    optimizer.add_param_group({"params": [q]})
    prefetch = prefetch_of(optimizer)  # p's state: q gets none from the step that raises
    fake_tiering.clear()
    fake_cuda.clear()
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step(raising_closure)
    assert _tags.current() == outside
    assert fake_tiering == [prefetch, EVICT]
    # The pool is left while the closure runs (Note [closures]), entered again after
    # it, and left for good by the guard.
    pool_events = [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")]
    assert pool_events == ([("enter_pool", 0), ("exit_pool", 0)] * 2 if mode == "pool" else [])
    optimizer.step()  # and the optimizer carries on as usual
    assert _tags.current() == outside
    assert fake_tiering == [prefetch, EVICT] * 2


def test_an_evict_that_fails_after_a_raising_step_does_not_hide_the_steps_error(
        fake_cuda, fake_tiering, monkeypatch):
    install()

    class FreshSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    def failing_evict(device, tag, stream):
        raise RuntimeError("tidepool: the copy engine is gone")

    monkeypatch.setattr(_tiering, "evict_tag", failing_evict)
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = FreshSGD([p], lr=0.1)
    outside = _tags.current()
    with pytest.warns(_install.TidepoolInactiveWarning, match="the copy engine is gone"), \
            pytest.raises(RuntimeError, match="boom"):
        optimizer.step(raising_closure)
    assert _tags.current() == outside


def test_where_warnings_are_errors_the_steps_own_error_still_comes_out(
        fake_cuda, fake_tiering, monkeypatch, capfd):
    """Review finding: under `-W error` the warning about the failed eviction took the
    step's error's place, and a loop catching that error (an OutOfMemoryError to retry)
    no longer caught it. The warning goes to stderr then."""
    install()

    def failing_evict(device, tag, stream):
        raise RuntimeError("tidepool: the copy engine is gone")

    monkeypatch.setattr(_tiering, "evict_tag", failing_evict)
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([p], lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="boom"):
            optimizer.step(raising_closure)
    assert "TidepoolInactiveWarning: tidepool: closing the scope of a step that raised" \
        in capfd.readouterr().err


def test_a_step_wrapped_before_the_install_is_guarded_from_the_install_on(fake_cuda,
                                                                          fake_tiering):
    class EarlySGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    optimizer = EarlySGD([p], lr=0.1, momentum=0.9)  # torch wraps EarlySGD.step now
    hooked = vars(EarlySGD)["step"]
    assert not getattr(hooked, "tidepool_guarded", False)
    install(state_budget="1GiB")
    assert EarlySGD.step.tidepool_guarded and EarlySGD.step.hooked  # not wrapped twice
    outside = _tags.current()
    p.grad = torch.ones(2)
    optimizer.step()  # state to prefetch
    fake_tiering.clear()
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step(raising_closure)
    assert _tags.current() == outside  # closed by the guard, not left to the next step
    assert _in_flight.in_flight() == {}
    assert fake_tiering == [prefetch_of(optimizer), EVICT]
    for handle in _install.STATE.optimizer_hooks:  # removal puts torch's wrapping back
        handle.remove()
    _install.STATE.optimizer_hooks = None
    assert vars(EarlySGD)["step"] is hooked


def unguarded(cls):
    """`cls` with its step() wrapped by torch's own step patcher, past tidepool's: a
    step with the hooks and no guard, as one wrapped by hand would be."""
    original_patcher = torch.optim.Optimizer.profile_hook_step.__wrapped__
    cls.step = original_patcher(cls.step)
    cls.step.hooked = True
    return cls


def test_a_step_without_the_guard_has_its_scope_closed_by_the_next_step(fake_cuda, fake_tiering):
    install()

    @unguarded
    class HandWrappedSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    optimizer = HandWrappedSGD([p], lr=0.1)
    assert not getattr(HandWrappedSGD.step, "tidepool_guarded", False)
    outside = _tags.current()
    p.grad = torch.ones(2)
    with pytest.raises(RuntimeError, match="boom"):
        optimizer.step(raising_closure)
    assert _tags.current() == _tags.OPTIMIZER_STATE  # no guard, and torch ran no post-hook
    optimizer.step()  # the next pre-hook closes the scope no running step owns
    assert _tags.current() == outside


def test_a_scope_an_unguarded_step_left_is_closed_and_evicted_by_the_next_guarded_step(
        fake_cuda, fake_tiering):
    # Review finding: a step reached past the guard (a bound method or a framework's
    # wrapper taken before a late tidepool.install()) that raised left its scope open, and
    # the next guarded step kept it as an enclosing step's: its tag stayed on after that
    # step, its step stayed in flight, and its devices were never evicted again.
    install(state_budget="1GiB")

    @unguarded
    class HandWrappedSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    class GuardedSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    p, q = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    hand = HandWrappedSGD([p], lr=0.1, momentum=0.9)
    guarded = GuardedSGD([q], lr=0.1, momentum=0.9)
    outside = _tags.current()
    p.grad, q.grad = torch.ones(2), torch.ones(3)
    hand.step()
    guarded.step()
    fake_tiering.clear()
    with pytest.raises(RuntimeError, match="boom"):
        hand.step(raising_closure)
    assert _tags.current() != outside  # no guard, and torch ran no post-hook
    guarded.step()
    assert _tags.current() == outside
    assert _in_flight.in_flight() == {}
    # The leftover's state is evicted as its guard would have, then the guarded step's.
    assert fake_tiering[0] == prefetch_of(hand)
    assert fake_tiering[1:] == [EVICT, prefetch_of(guarded), EVICT]
    fake_tiering.clear()
    guarded.step()  # and the steps after it go on as usual
    assert fake_tiering == [prefetch_of(guarded), EVICT]
    assert _tags.current() == outside


@pytest.mark.parametrize("mode,budget", [("global", "0"), ("pool", "1GiB")])
def test_a_step_inside_a_step_keeps_the_outer_scope(fake_cuda, fake_tiering, mode, budget):
    install(mode=mode, state_budget=budget)

    class Inner(torch.optim.SGD):
        seen: list = []

        def step(self, closure=None):
            Inner.seen.append(_tags.current())
            return super().step(closure)

    class Lookahead(torch.optim.SGD):  # a wrapper whose step runs another optimizer's
        seen: list = []

        def __init__(self, params, inner):
            super().__init__(params, lr=0.0)
            self.inner = inner

        def step(self, closure=None):
            Lookahead.seen.append(_tags.current())
            self.inner.step()
            Lookahead.seen.append(_tags.current())
            return super().step(closure)

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))
    a.grad, b.grad = torch.ones(2), torch.ones(3)
    outer = Lookahead([a], Inner([b], lr=0.1, momentum=0.9))
    outside = _tags.current()
    outer.step()
    assert Inner.seen == [_tags.OPTIMIZER_STATE]
    assert Lookahead.seen == [_tags.OPTIMIZER_STATE, _tags.OPTIMIZER_STATE]
    assert _tags.current() == outside
    # The state is evicted once, after the outermost step; one pool scope per device.
    assert fake_tiering == [EVICT]
    pool_events = [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")]
    assert pool_events == ([("enter_pool", 0), ("exit_pool", 0)] if mode == "pool" else [])
    # Now the inner optimizer has state (Lookahead, without momentum, has none): its
    # nested step prefetches it, on the device the outer step holds.
    fake_tiering.clear()
    outer.step()
    moves = ([prefetch_of(outer.inner)] if budget != "0" else []) + [EVICT]
    assert fake_tiering == moves
    assert Inner.seen[-1] == Lookahead.seen[-1] == _tags.WORKSPACE
    fake_tiering.clear()
    with pytest.raises(RuntimeError, match="boom"):
        outer.inner.step(raising_closure)  # an inner step that raises on its own
    assert _tags.current() == outside
    assert fake_tiering == moves


def test_a_guarded_step_inside_an_unguarded_one_keeps_its_scope(fake_cuda, fake_tiering):
    install()

    @unguarded
    class EarlyWrapper(torch.optim.SGD):
        seen: list = []

        def __init__(self, params, inner=None):
            super().__init__(params, lr=0.0)
            self.inner = inner

        def step(self, closure=None):
            self.inner.step()
            EarlyWrapper.seen.append(_tags.current())
            return super().step(closure)

    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(3))

    class LateInner(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    a.grad, b.grad = torch.ones(2), torch.ones(3)
    outer = EarlyWrapper([a], LateInner([b], lr=0.1))
    assert not getattr(EarlyWrapper.step, "tidepool_guarded", False)
    outside = _tags.current()
    outer.step()
    assert EarlyWrapper.seen == [_tags.OPTIMIZER_STATE]
    assert _tags.current() == outside


@pytest.mark.parametrize("where", ["pre", "post"])
def test_a_hook_that_raises_closes_the_scope_too(fake_cuda, fake_tiering, where):
    # torch runs tidepool's pre-hook before an optimizer's own and its post-hook after:
    # an own hook that raises skips tidepool's post-hook as a raising step() does.
    install(mode="pool")

    class FreshSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    def failing_hook(optimizer, args, kwargs):
        raise ValueError("gradient check failed")

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    optimizer = FreshSGD([p], lr=0.1)
    register = (optimizer.register_step_pre_hook if where == "pre"
                else optimizer.register_step_post_hook)
    register(failing_hook)
    outside = _tags.current()
    with pytest.raises(ValueError, match="gradient check failed"):
        optimizer.step()
    assert _tags.current() == outside
    assert [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")] == [
        ("enter_pool", 0), ("exit_pool", 0)]
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)]


def pool_mode_sgd_with_state():
    """tidepool installed in pool mode with a state budget, and an SGD whose first step
    made its state (evicted after the step); returns (its parameter, the optimizer)."""
    install(mode="pool", state_budget="1GiB")
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.grad = torch.ones(2)
    optimizer.step()  # the state, evicted
    return p, optimizer


def test_state_prefetched_for_a_step_whose_scope_did_not_open_is_evicted(
        fake_cuda, fake_tiering, monkeypatch):
    p, optimizer = pool_mode_sgd_with_state()
    monkeypatch.setattr(torch.cuda, "use_mem_pool", lambda pool, device=None: 1 / 0)
    q = torch.nn.Parameter(torch.ones(3))  # the next step makes its state: it takes a pool
    optimizer.add_param_group({"params": [q]})
    q.grad = torch.ones(3)
    fake_tiering.clear()
    with pytest.raises(ZeroDivisionError):
        optimizer.step()
    assert fake_tiering == [prefetch_of(optimizer), EVICT]
    assert _in_flight.in_flight() == {}


@pytest.mark.parametrize("mode", ["global", "pool"])
def test_loaded_state_is_taken_into_tiering_and_evicted(fake_cuda, fake_tiering, untiered_state,
                                                        mode):
    # Note [loaded state]: resuming from a checkpoint must not leave the state resident.
    install(mode=mode, tier_min_bytes="64")
    torch.manual_seed(0)
    grads = [torch.randn(8, 4) for _ in range(4)]

    def model():
        return torch.nn.Parameter(torch.linspace(-1, 1, 32).reshape(8, 4))

    p = model()
    optimizer = torch.optim.AdamW([p], lr=1e-2)
    for g in grads[:2]:
        p.grad = g.clone()
        optimizer.step()
    # What torch.save / torch.load would give: copies, not the live state.
    checkpoint = {"param": p.detach().clone(), "optimizer": copy.deepcopy(optimizer.state_dict())}
    for g in grads[2:]:
        p.grad = g.clone()
        optimizer.step()
    uninterrupted = p.detach().clone()

    resumed = model()
    with torch.no_grad():
        resumed.copy_(checkpoint["param"])
    optimizer = torch.optim.AdamW([resumed], lr=1e-2)
    fake_tiering.clear()
    outside = _tags.current()
    optimizer.load_state_dict(checkpoint["optimizer"])
    state = optimizer.state[resumed]
    # exp_avg and exp_avg_sq (128 bytes each) are taken in under optimizer_state; the
    # 4-byte step counter stays below tier_min_bytes.
    assert untiered_state.adopted_under == [_tags.OPTIMIZER_STATE] * 2
    assert all(_tiering.owns(0, state[k].data_ptr()) for k in ("exp_avg", "exp_avg_sq"))
    assert not _tiering.owns(0, state["step"].data_ptr())
    assert torch.equal(state["exp_avg"], checkpoint["optimizer"]["state"][0]["exp_avg"])
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)]
    assert _tags.current() == outside
    pool_events = [c for c in fake_cuda if c[0] in ("enter_pool", "exit_pool")]
    assert pool_events[-2:] == ([("enter_pool", 0), ("exit_pool", 0)] if mode == "pool" else [])
    for g in grads[2:]:
        resumed.grad = g.clone()
        optimizer.step()
    assert torch.equal(resumed.detach(), uninterrupted), "resuming changes no bit"
    # A tensor subclass without the flatten protocol is not one storage to copy: left as
    # it is (DTensor has the protocol: test_loaded_dtensor_state_...).
    assert _state_tensors._plain_parts(torch.nn.Parameter(torch.ones(64))) == []
    # Loading state that is already tiered (the same tensors) copies nothing; the eviction
    # comes all the same (what a load makes in tiering may be on the device).
    fake_tiering.clear()
    optimizer.load_state_dict(optimizer.state_dict())
    assert len(untiered_state.adopted_under) == 2
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)]


@pytest.mark.parametrize("mode", ["global", "pool"])
def test_state_the_load_makes_on_the_device_is_made_in_tiering(fake_cuda, fake_tiering,
                                                                untiered_state, mode):
    """Review finding: torch's load copies each state tensor to its parameter's device
    (here: a float64 checkpoint made float32), and made outside any scope, all of the
    state was ordinary device memory at once before the adoption copied it: a run whose
    state fits only off the device ran out of memory resuming. Made under the tag, it is
    in tiering from the start: nothing is copied after."""
    install(mode=mode, tier_min_bytes="64")
    p = torch.nn.Parameter(torch.linspace(-1, 1, 32).reshape(8, 4))
    optimizer = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.ones(8, 4)
    optimizer.step()
    checkpoint = copy.deepcopy(optimizer.state_dict())
    for key in ("exp_avg", "exp_avg_sq"):
        checkpoint["state"][0][key] = checkpoint["state"][0][key].double()
    resumed = torch.optim.AdamW([p], lr=1e-2)
    untiered_state.adopted_under.clear()
    fake_tiering.clear()
    outside = _tags.current()
    resumed.load_state_dict(checkpoint)
    state = resumed.state[p]
    assert state["exp_avg"].dtype == torch.float32
    assert all(_tiering.owns(0, state[k].data_ptr()) for k in ("exp_avg", "exp_avg_sq"))
    assert untiered_state.adopted_under == [], "copied after the load: made outside tiering"
    assert torch.equal(state["exp_avg_sq"], optimizer.state[p]["exp_avg_sq"])
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)]
    assert _tags.current() == outside and _in_flight.in_flight() == {}


def test_a_loaded_state_that_cannot_be_copied_is_said_and_still_evicted(
        fake_cuda, fake_tiering, untiered_state, monkeypatch):
    """Review finding: a copy that failed made load_state_dict raise after torch's load
    had succeeded, and skipped the eviction. Said, as after a step, and evicted."""
    install(tier_min_bytes="64")
    p = torch.nn.Parameter(torch.zeros(32))
    optimizer = torch.optim.AdamW([p], lr=1e-2)
    p.grad = torch.ones(32)
    optimizer.step()
    checkpoint = copy.deepcopy(optimizer.state_dict())

    def out_of_memory(value):
        raise torch.OutOfMemoryError("no room for the copy")
    monkeypatch.setattr(_adoption, "_adopt_tensor", out_of_memory)
    fake_tiering.clear()
    with pytest.warns(_install.TidepoolInactiveWarning, match="loaded optimizer state could "
                      "not be copied into tiering.*no room for the copy"):
        optimizer.load_state_dict(checkpoint)
    assert torch.equal(optimizer.state[p]["exp_avg"], checkpoint["state"][0]["exp_avg"])
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)]
    assert _in_flight.in_flight() == {}


@pytest.fixture
def fake_process_group():
    """A two-rank process group whose collectives do nothing (PyTorch's own "fake"
    backend), enough for DTensor on the CPU in one process."""
    import torch.distributed as dist
    if not dist.is_available():
        pytest.skip("this torch has no torch.distributed")
    from torch.distributed.tensor import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield init_device_mesh("cpu", (2,))
    dist.destroy_process_group()


def test_loaded_dtensor_state_is_taken_in_through_its_local_shard(
        fake_cuda, fake_tiering, untiered_state, fake_process_group):
    # FSDP2 keeps each rank's optimizer state as DTensors over its shard: the local shard
    # is the memory to tier, the DTensor around it keeps its mesh and placements.
    from torch.distributed.tensor import DTensor, Shard
    install(tier_min_bytes="64")
    mesh = fake_process_group

    def sharded(local):
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False)

    torch.manual_seed(0)
    grads = [torch.randn(32) for _ in range(4)]
    p = torch.nn.Parameter(sharded(torch.linspace(-1, 1, 32)))
    optimizer = torch.optim.AdamW([p], lr=1e-2)
    for g in grads[:2]:
        p.grad = sharded(g.clone())
        optimizer.step()
    checkpoint = {"param": p.to_local().detach().clone(),
                  "optimizer": copy.deepcopy(optimizer.state_dict())}
    for g in grads[2:]:
        p.grad = sharded(g.clone())
        optimizer.step()
    uninterrupted = p.to_local().detach().clone()

    resumed = torch.nn.Parameter(sharded(checkpoint["param"].clone()))
    optimizer = torch.optim.AdamW([resumed], lr=1e-2)
    untiered_state.adopted_under.clear()
    fake_tiering.clear()
    optimizer.load_state_dict(checkpoint["optimizer"])
    state = optimizer.state[resumed]
    # exp_avg's and exp_avg_sq's shards
    assert untiered_state.adopted_under == [_tags.OPTIMIZER_STATE] * 2
    for key in ("exp_avg", "exp_avg_sq"):
        assert type(state[key]) is DTensor
        assert state[key].placements == (Shard(0),) and state[key].device_mesh == mesh
        assert state[key]._spec == checkpoint["optimizer"]["state"][0][key]._spec
        assert state[key].grad_fn is None
        assert _tiering.owns(0, state[key].to_local().data_ptr())
        assert torch.equal(state[key].to_local(),
                           checkpoint["optimizer"]["state"][0][key].to_local())
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)]
    for g in grads[2:]:
        resumed.grad = sharded(g.clone())
        optimizer.step()
    assert torch.equal(resumed.to_local().detach(), uninterrupted), "resuming changes no bit"


def test_load_state_dict_is_put_back_on_removal(fake_cuda, fake_tiering):
    original = torch.optim.Optimizer.load_state_dict
    install()
    assert torch.optim.Optimizer.load_state_dict is not original
    assert torch.optim.Optimizer.load_state_dict.__wrapped__ is original
    for handle in _install.STATE.optimizer_hooks:
        handle.remove()
    _install.STATE.optimizer_hooks = None
    assert torch.optim.Optimizer.load_state_dict is original


def test_torchs_step_patcher_is_put_back_as_the_staticmethod_it_was(fake_cuda, fake_tiering):
    original = vars(torch.optim.Optimizer)["profile_hook_step"]
    install()
    assert vars(torch.optim.Optimizer)["profile_hook_step"] is not original
    for handle in _install.STATE.optimizer_hooks:
        handle.remove()
    _install.STATE.optimizer_hooks = None
    assert vars(torch.optim.Optimizer)["profile_hook_step"] is original

    class LaterSGD(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    LaterSGD([p], lr=0.5).step()
    assert torch.equal(p.detach(), torch.full((2,), 0.5))
    assert not getattr(LaterSGD.step, "tidepool_guarded", False)


def test_stock_adamw_foreach_and_plain_give_identical_results_with_the_hooks(fake_cuda,
                                                                              fake_tiering):
    torch.manual_seed(0)
    grads = [torch.randn(5, 3) for _ in range(3)]

    def train(foreach):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 15).reshape(5, 3))
        optimizer = torch.optim.AdamW([p], lr=1e-2, foreach=foreach)
        for g in grads:
            p.grad = g.clone()
            optimizer.step()
        return p.detach().clone()

    reference = train(False)
    foreach_reference = train(True)
    install()
    # The hooks change nothing, bit for bit, on either path; the two paths themselves
    # differ by rounding alone.
    assert torch.equal(train(False), reference)
    assert torch.equal(train(True), foreach_reference)
    assert torch.allclose(foreach_reference, reference, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit, imported by dynamo
def test_a_compiled_training_step_still_moves_the_state(fake_cuda, fake_tiering):
    # torch.compile traces through torch's hooked step: the hooks and the guard (ctypes
    # calls, thread-local scopes) must still run around every step, in order.
    install()

    class FreshAdamW(torch.optim.AdamW):
        def step(self, closure=None):
            return super().step(closure)

    p = torch.nn.Parameter(torch.ones(4))
    optimizer = FreshAdamW([p], lr=0.1)
    outside = _tags.current()

    @torch.compile(backend="eager")
    def train_step():
        p.grad = torch.ones(4)
        optimizer.step()

    for _ in range(3):
        train_step()
    assert _tags.current() == outside
    assert fake_tiering == [("evict", 0, _tags.OPTIMIZER_STATE, 4242)] * 3
