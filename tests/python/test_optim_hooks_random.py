"""The optimizer step hooks through random training sequences, on a machine without a GPU
(torch's CUDA entry points and the tiering C ABI are recorders: fake_torch_cuda.py and
fake_tiering.py; tags go through the real libtidepool).

Several stock torch.optim optimizers (LBFGS among them), a Lookahead that steps an inner
one, and an optimizer that makes its state anew each step, each on parameters of its own,
run a random sequence of steps (some parameters without a
gradient), steps with a closure, steps whose closure raises, zero_grad, a parameter group
added, a state_dict round trip, the hooks taken off and registered again, and an
optimizer replaced by a new one.
The same sequence runs once without tidepool and once with the hooks installed, and the
hooks must be invisible to training and keep their own books:
  - every parameter and every state tensor is bit for bit what it is without them;
  - after each step that ran, every state tensor of the stepped optimizer is in a
    pointer-stable range (the fake placement of fake_tiering.py: state made outside an
    optimizer_state scope, by LBFGS, by the renewing optimizer, by Adagrad's __init__, is
    taken in after the step: Note [state made in workspace steps]);
  - after each operation the allocation tag is the one in force before it, tidepool's
    pool (pool mode) is not entered, no step is counted in flight, and a step that raised
    raised the closure's own error;
  - every step that ran ends with an eviction of the state.
TIDEPOOL_TEST_SEED draws other sequences (tests/support/test_seed.h for the C++ tests);
TIDEPOOL_TEST_SCALE makes them longer."""

from __future__ import annotations

import random

import pytest
import torch

from tidepool import _in_flight, _install, _optim_hooks, _tags

from fake_tiering import fake_tiering, state_tensors, untiered_state  # noqa: F401  (fixtures)
from fake_torch_cuda import fake_cuda, install  # noqa: F401  (a fixture, and the install)
from per_parameter import PerParameter
from random_sequences import scaled, seeds

class Lookahead(torch.optim.Optimizer):
    """An optimizer that steps another inside its own step (Lookahead: every k steps the
    weights move halfway back to slow copies it keeps in its state)."""

    def __init__(self, params, k=2, alpha=0.5):
        params = list(params)
        super().__init__(params, {"k": k, "alpha": alpha})
        self.inner = torch.optim.SGD(params, lr=0.05, momentum=0.9)

    @torch.no_grad()
    def step(self, closure=None):
        loss = self.inner.step(closure)
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if "slow" not in state:
                    state["slow"], state["count"] = p.detach().clone(), 0
                state["count"] += 1
                if state["count"] % group["k"] == 0:
                    state["slow"].add_(p - state["slow"], alpha=group["alpha"])
                    p.copy_(state["slow"])
        return loss


class Renewing(PerParameter):
    """Heavy-ball momentum written without in-place updates of its state: each step makes
    the buffer anew (state["buf"] = beta * buf + grad), as some hand-written optimizers do."""

    def __init__(self, params, lr=0.05, beta=0.8):
        super().__init__(params, {"lr": lr, "beta": beta})

    def update(self, group, p):
        state = self.state[p]
        state["buf"] = group["beta"] * state.get("buf", 0) + p.grad
        p.sub_(group["lr"] * state["buf"])


OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2, amsgrad=True),
    "AdamW-foreach": lambda params: torch.optim.AdamW(params, lr=1e-2, foreach=True),
    "RMSprop": lambda params: torch.optim.RMSprop(params, lr=1e-2, momentum=0.5, centered=True),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.1),
    "NAdam": lambda params: torch.optim.NAdam(params, lr=1e-2),
    "Rprop": lambda params: torch.optim.Rprop(params, lr=1e-2),
    "Adadelta": lambda params: torch.optim.Adadelta(params),
    "Lookahead(SGD)": lambda params: Lookahead(params),
    "LBFGS": lambda params: torch.optim.LBFGS(params, lr=0.1, max_iter=3, history_size=3),
    "Renewing": lambda params: Renewing(params),
}
# Optimizers whose later param groups get no state of theirs: torch's Adagrad makes its
# state in __init__, and Lookahead's inner optimizer keeps the groups it was made with;
# LBFGS takes one group only.
NO_ADDED_GROUPS = ("Adagrad", "Lookahead(SGD)", "LBFGS")
# Optimizers that step only with a closure.
CLOSURE_ONLY = ("LBFGS",)
TIER_MIN_BYTES = 16  # tidepool.tier_min_bytes: state of parameters of 2 rows or more


class ClosureError(RuntimeError):
    pass


def snapshot(optimizers) -> list[torch.Tensor]:
    """Every parameter and every tensor of every optimizer's state, in a fixed order."""
    out = []
    for optimizer in optimizers + [o.inner for o in optimizers if isinstance(o, Lookahead)]:
        for group in optimizer.param_groups:
            for p in group["params"]:
                out.append(p.detach().clone())
                for key in sorted(optimizer.state.get(p, {})):
                    out += [t.detach().clone() for t in state_tensors(optimizer.state[p][key])]
    return out


def run(seed: int, operations: int, on_each=None) -> list[list[torch.Tensor]]:
    """The random sequence of `seed`; the snapshots after each operation. on_each(kind,
    raised, optimizer) is called after each."""
    rng = random.Random(seed)
    torch.manual_seed(seed)

    def fresh(name):
        params = [torch.nn.Parameter(torch.randn(rng.randint(1, 6), 3)) for _ in range(3)]
        return name, params, OPTIMIZERS[name](params)

    slots = [fresh(name) for name in rng.sample(sorted(OPTIMIZERS), 3)]
    snapshots = []
    for _ in range(operations):
        i = rng.randrange(len(slots))
        name, own, optimizer = slots[i]
        kind = rng.choices(["step", "closure", "raising closure", "zero_grad", "add group",
                            "state_dict", "hooks again", "new optimizer"],
                           weights=[50, 20, 5, 10, 3, 5, 2, 3])[0]
        grads = [torch.randn(p.shape) if rng.random() < 0.8 else None for p in own]
        raised = None
        if kind == "step" and name in CLOSURE_ONLY:
            kind = "closure"
        if kind == "step":
            for p, g in zip(own, grads):
                p.grad = g
            optimizer.step()
        elif kind in ("closure", "raising closure"):
            def closure():
                if kind == "raising closure":
                    raise ClosureError("the closure's own error")
                optimizer.zero_grad()
                loss = sum((p * p).sum() for p in own)
                loss.backward()
                return loss

            try:
                optimizer.step(closure)
            except ClosureError as e:
                raised = e
        elif kind == "zero_grad":
            optimizer.zero_grad(set_to_none=rng.random() < 0.5)
        elif kind == "add group" and len(own) < 6 and name not in NO_ADDED_GROUPS:
            p = torch.nn.Parameter(torch.randn(rng.randint(1, 4), 3))
            own.append(p)
            optimizer.add_param_group({"params": [p]})
        elif kind == "state_dict":
            optimizer.load_state_dict(optimizer.state_dict())
        elif kind == "new optimizer":  # made after the install; the old one is dropped
            slots[i] = fresh(rng.choice(sorted(OPTIMIZERS)))
        # "hooks again": on_each takes the hooks off and registers them anew.
        if on_each is not None:
            on_each(kind, raised, optimizer)
        snapshots.append(snapshot([optimizer for _, _, optimizer in slots]))
    return snapshots


@pytest.mark.parametrize("mode", ["global", "pool"])
@pytest.mark.parametrize("seed", seeds(3))
def test_random_training_is_bitwise_the_same_and_every_step_ends_evicted(fake_cuda,
                                                                          fake_tiering,
                                                                          untiered_state, seed,
                                                                          mode):
    operations = scaled(120)
    reference = run(seed, operations)

    install(mode=mode, state_budget="1GiB", tier_min_bytes=str(TIER_MIN_BYTES))
    outside = _tags.current()
    steps = 0

    def check(kind, raised, optimizer):
        nonlocal steps
        if kind == "hooks again":  # off and on: the guards come back with them
            for handle in _install.STATE.optimizer_hooks:
                handle.remove()
            _install.STATE.optimizer_hooks = _optim_hooks.register(torch)
        assert _tags.current() == outside, f"after {kind}: the tag in force changed"
        pools_entered = sum({"enter_pool": 1, "exit_pool": -1}.get(c[0], 0) for c in fake_cuda)
        assert pools_entered == 0, f"after {kind}: tidepool's pool is still entered"
        assert _in_flight.in_flight() == {}, f"after {kind}: a step is still in flight"
        if kind == "raising closure":
            assert isinstance(raised, ClosureError), "the closure's error did not come out"
        if kind in ("step", "closure", "raising closure"):
            steps += 1
            assert fake_tiering, f"after {kind}: nothing moved"
            assert fake_tiering[-1][0] in ("evict", "evict_ptrs"), (
                f"after {kind}: the last move was {fake_tiering[-1]}, not an eviction")
            fake_tiering.clear()
        if kind in ("step", "closure"):
            for t in state_tensors(list(optimizer.state.values()), TIER_MIN_BYTES):
                assert untiered_state.tiered(t), (
                    f"after {kind} of {type(optimizer).__name__}: state left out")

    hooked = run(seed, operations, check)
    assert steps > 0
    for n, (want, got) in enumerate(zip(reference, hooked)):
        assert len(want) == len(got), f"operation {n}: another number of state tensors"
        for a, b in zip(want, got):
            assert torch.equal(a, b), f"operation {n}: a tensor differs with the hooks"
