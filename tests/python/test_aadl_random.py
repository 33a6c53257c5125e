"""Random sequences of what a training script does with tidepool.optim.AADL, run in
lockstep by four copies of the same training that differ only in how AADL is reached and
where its history lives: AADL(inner) with the history in "device" memory (on the CPU: the
parameters' own), "host" and "tiered", and accelerate(inner) with a host history.

The sequence draws the inner optimizer (SGD with momentum, Adam, RMSprop) and AADL's
options (both acceleration types, relaxation, wait_iterations, history_depth,
store_each_nth, frequency, reg_acc), then steps with and without a closure (the
safeguard keeps or rejects the accelerated iterate), some parameters without a gradient,
learning-rate changes on the inner optimizer (as a scheduler makes them), zero_grad with
and without set_to_none, and save -> load into a new optimizer (another placement, and
between the two ways in) in the middle of the run. After every operation the four
copies must agree bit for bit: parameters, history sizes, accepted and rejected counts.
(The values themselves are checked against the published AADL by the golden files, in
test_optim.py and tests/optimizers, and on random options in test_aadl_reference.py.)

TIDEPOOL_TEST_SEED=N draws other sequences, TIDEPOOL_TEST_SCALE=S makes them longer
(random_sequences.py)."""

from __future__ import annotations

import io
import random

import pytest
import torch

import tidepool.optim as topt

from golden_problems import take_step
from optim_binding import skip_without_binding
from random_sequences import scaled, seeds

skip_without_binding()

# How each copy reaches AADL: (the way in, where its history lives).
WAYS_IN = (("AADL", "device"), ("AADL", "host"), ("AADL", "tiered"), ("accelerate", "host"))
INNER = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.5),
    "Adam": lambda params: torch.optim.Adam(params, lr=0.02),
    "RMSprop": lambda params: torch.optim.RMSprop(params, lr=0.01, momentum=0.3),
}


def random_options(rng: random.Random) -> dict:
    return {"acceleration_type": rng.choice(["anderson", "anderson_normal_equation"]),
            "relaxation": rng.choice([0.1, 0.5, 1.0]),
            "wait_iterations": rng.randint(0, 3),
            "history_depth": rng.randint(3, 6),
            "store_each_nth": rng.randint(1, 3),
            "frequency": rng.randint(1, 3),
            "reg_acc": rng.choice([0.0, 1e-8])}


class Copy:
    """One copy of the training: its parameters, its inner optimizer and its AADL (`opt`,
    which for the accelerate() way in is the AADL accelerate returned; `stepper` is what
    the script calls step() on)."""

    def __init__(self, way: str, where: str, inner: str, options: dict, init: list):
        self.params = [t.detach().clone().requires_grad_() for t in init]
        self.make(way, where, inner, options)

    def make(self, way: str, where: str, inner: str, options: dict) -> None:
        self.way, self.where = way, where
        self.inner = INNER[inner](self.params)
        if way == "AADL":
            self.opt = self.stepper = topt.AADL(self.inner, history=where, **options)
        else:
            self.opt = topt.accelerate(self.inner, history=where, **options)
            self.stepper = self.inner

    def summary(self) -> tuple:
        return (self.opt.history_size(), self.opt.accepted, self.opt.rejected)


@pytest.mark.parametrize("seed", seeds(4))
def test_random_use_of_aadl_is_bitwise_the_same_in_every_placement_and_way_in(seed):
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    dtype = rng.choice([torch.float32, torch.float64])
    X = torch.randn(40, 6, generator=gen, dtype=dtype)
    Y = torch.randn(40, 2, generator=gen, dtype=dtype)
    init = [torch.randn(shape, generator=gen, dtype=dtype)
            for shape in ((8, 6), (8,), (2, 8), (2,))]

    def loss_of(params, use_b2: bool):
        w1, c1, w2, c2 = params
        y = torch.tanh(X @ w1.t() + c1) @ w2.t() + (c2 if use_b2 else 0)
        return ((y - Y) ** 2).mean()

    inner = rng.choice(sorted(INNER))
    options = random_options(rng)
    copies = [Copy(way, where, inner, options, init) for way, where in WAYS_IN]
    context = f"seed {seed}: {inner}, {options}, {dtype}"
    for step in range(scaled(40)):
        action = rng.random()
        if action < 0.1:
            factor = rng.choice([0.5, 2.0])
            for c in copies:
                for group in c.inner.param_groups:
                    group["lr"] *= factor
        elif action < 0.18:
            victim = rng.randrange(len(copies))
            c = copies[victim]
            buffer = io.BytesIO()
            torch.save(c.opt.state_dict(), buffer)
            buffer.seek(0)
            way, where = rng.choice(WAYS_IN)
            c.make(way, where, inner, options)
            c.opt.load_state_dict(torch.load(buffer))
        elif action < 0.25:
            set_to_none = rng.random() < 0.5
            for c in copies:
                c.stepper.zero_grad(set_to_none=set_to_none)
        use_b2 = rng.random() < 0.8
        with_closure = rng.random() < 0.4
        for c in copies:
            take_step(c.stepper, lambda c=c: loss_of(c.params, use_b2), with_closure)
        first = copies[0]
        for c in copies[1:]:
            where = f"{context}, step {step}: {c.way}/{c.where} against {first.way}/{first.where}"
            assert c.summary() == first.summary(), where
            for index, (a, b) in enumerate(zip(c.params, first.params)):
                assert torch.equal(a, b), f"{where}, parameter {index}: {(a - b).abs().max()}"
    assert first.opt.history_size() > 0, f"{context}: nothing was stored"
