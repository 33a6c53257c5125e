"""Random sequences of what a training script does with tidepool.optim.Apollo, each run
beside ReferenceApollo (reference_apollo.py: the published Apollo's algorithm and state
layout, checked against the golden runs in test_optim.py) on the same fp64 problem: steps
with and without a closure, some parameters without a gradient, learning-rate changes (as
a scheduler makes them), a parameter group added later, fused steps turned on and off,
the optimizer saved and loaded into a new one in another placement.

Apollo's dynamics amplify rounding (with these random options, a difference of 1e-15
grows to 1e-5 in 30 steps, every single step agreeing to 1e-15), so every few steps (at
most MAX_UNSYNCED) tidepool's optimizer takes the reference's parameters and, through
load_state_dict, its state: the steps in between carry tidepool's own state (the fused
step's carried sums among it), and after every step all parameters must agree within
1e-9 relative.

TIDEPOOL_TEST_SEED=N draws other sequences, TIDEPOOL_TEST_SCALE=S makes them longer
(random_sequences.py)."""

from __future__ import annotations

import io
import random

import pytest
import torch

import tidepool.optim as topt

from optim_binding import skip_without_binding
from random_sequences import scaled, seeds
from reference_apollo import ReferenceApollo

skip_without_binding()

TOLERANCE = 1e-9
FLOOR = 1e-3
MAX_UNSYNCED = 4
PLACEMENTS = ("device", "host", "tiered")


def random_options(rng: random.Random) -> dict:
    """A group's options; init_lr, base_lr and weight_decay_type given or not (then both
    take them from the constructor's arguments)."""
    lr = rng.choice([0.005, 0.02, 0.05])
    options = {"lr": lr, "base_lr": lr, "init_lr": lr * rng.choice([0.0, 0.001, 0.5]),
               "beta": rng.choice([0.5, 0.9]), "eps": rng.choice([1e-4, 1e-6]),
               "rebound": rng.choice(["constant", "belief"]), "warmup": rng.randint(0, 5),
               "weight_decay": rng.choice([0.0, 1e-3, 0.05]),
               "weight_decay_type": rng.choice(["L2", "decoupled", "stable"])}
    for key in ("base_lr", "init_lr", "weight_decay_type"):
        if rng.random() < 0.4:
            del options[key]
    return options


@pytest.mark.parametrize("seed", seeds(6))
def test_random_use_of_apollo_follows_the_reference(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(40, 6, generator=gen, dtype=torch.float64)
    Y = torch.randn(40, 2, generator=gen, dtype=torch.float64)

    def make(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
    W1, b1, W2, b2 = make((8, 6)), make((8,)), make((2, 8)), make((2,))
    mine = [t.detach().clone().requires_grad_() for t in (W1, b1, W2, b2)]
    theirs = [t.detach().clone().requires_grad_() for t in (W1, b1, W2, b2)]

    def loss_of(params, use_b2: bool):
        w1, c1, w2, c2 = params
        y = torch.tanh(X @ w1.t() + c1) @ w2.t() + (c2 if use_b2 else 0)
        return ((y - Y) ** 2).mean()

    first = random_options(rng)
    later = random_options(rng)
    where = rng.choice(PLACEMENTS)
    top_lr = rng.choice([0.01, 0.03])  # the constructor's: the defaults' source
    opt = topt.Apollo([{"params": mine[:3], **first}], lr=top_lr, state=where,
                      fused=rng.random() < 0.7)
    ref = ReferenceApollo([{"params": theirs[:3], **first}], lr=top_lr)
    grouped, unsynced = False, 0
    for step in range(scaled(30)):
        action = rng.random()
        if not grouped and (action < 0.1 or step == 15):
            opt.add_param_group({"params": [mine[3]], **later})
            ref.add_param_group({"params": [theirs[3]], **later})
            grouped = True
        elif action < 0.2:
            group = rng.randrange(len(opt.param_groups))
            factor = rng.choice([0.0, 0.5, 2.0])
            for o in (opt, ref):
                o.param_groups[group]["lr"] *= factor
        elif action < 0.27:
            buffer = io.BytesIO()
            torch.save(opt.state_dict(), buffer)
            buffer.seek(0)
            where = rng.choice(PLACEMENTS)
            # Made as the script made the first one (its constructor's arguments are the
            # defaults of groups added later, as in torch.optim), with other group
            # options, which load_state_dict must replace.
            opt = topt.Apollo([{"params": list(g["params"]), "lr": 1.0, "beta": 0.1}
                               for g in opt.param_groups],
                              lr=top_lr, state=where, fused=rng.random() < 0.7)
            opt.load_state_dict(torch.load(buffer))
        elif action < 0.32:
            opt.fused = not opt.fused
        if rng.random() < 0.3 or unsynced >= MAX_UNSYNCED:
            with torch.no_grad():
                for a, b in zip(mine, theirs):
                    a.copy_(b)
            opt.load_state_dict(ref.state_dict())
            unsynced = 0
        unsynced += 1
        use_b2 = rng.random() < 0.8
        with_closure = rng.random() < 0.3
        for o, params in ((opt, mine), (ref, theirs)):
            if with_closure:
                def closure(o=o, params=params):
                    o.zero_grad()
                    value = loss_of(params, use_b2)
                    value.backward()
                    return value
                o.step(closure)
            else:
                o.zero_grad()
                loss_of(params, use_b2).backward()
                o.step()
        for index, (a, b) in enumerate(zip(mine, theirs)):
            scaled_error = ((a - b).abs() / (FLOOR + b.abs())).max().item()
            assert scaled_error <= TOLERANCE, (
                f"seed {seed}, step {step}, parameter {index}: deviation {scaled_error:.3e} "
                f"(placement {where}, fused {opt.fused}, groups {len(opt.param_groups)})")
