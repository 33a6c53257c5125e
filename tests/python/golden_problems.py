"""The golden trajectories of ../shared/golden (the published Apollo and AADL on a small
float64 problem; format and tolerance in its README): the problem rebuilt in torch, and
one run of an optimizer through a file's step protocol, measured against it. Shared by
test_optim.py (tidepool.optim) and test_aadl_reference.py (reference_aadl.py)."""

from __future__ import annotations

import glob
import json
import os

import torch

SHARED = os.environ.get("TIDEPOOL_SHARED_DIR",
                        os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared"))
GOLDEN = sorted(glob.glob(os.path.join(SHARED, "golden", "*.json")))
# ../shared/golden/README.md: |x - ref| <= 1e-6 * (1e-3 + |ref|) at every step.
GOLDEN_TOLERANCE = 1e-6
GOLDEN_FLOOR = 1e-3


def deviation(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest |got - want| / (GOLDEN_FLOOR + |want|): the golden README's measure.
    A NaN anywhere is an infinite deviation (max(worst, nan) would keep worst: Python's
    max drops a NaN that comes second)."""
    d = ((got - want).abs() / (GOLDEN_FLOOR + want.abs())).max().item()
    return float("inf") if d != d else d


def take_step(opt, loss, with_closure: bool) -> None:
    """One step of `opt` on `loss()`: through a closure that zeroes the gradients and runs
    backward only in grad mode (AADL's safeguard calls it again with grad mode off, for the
    loss alone), or plainly: zero_grad, backward, step()."""
    if with_closure:
        def closure():
            grad = torch.is_grad_enabled()
            if grad:
                opt.zero_grad()
            value = loss()
            if grad:
                value.backward()
            return value
        opt.step(closure)
    else:
        opt.zero_grad()
        loss().backward()
        opt.step()


class Golden:
    def __init__(self, path: str):
        with open(path) as f:
            data = json.load(f)
        p = data["problem"]
        self.name = data["name"]
        self.optimizer = data["optimizer"]
        self.closure = p["step_protocol"].startswith("closure")
        self.X = torch.tensor(p["X"], dtype=torch.float64).reshape(p["X_shape"])
        self.Y = torch.tensor(p["Y"], dtype=torch.float64).reshape(p["Y_shape"])
        self.shapes = p["param_shapes"]
        self.init = p["init_params"]
        self.steps = data["steps"]

    def params(self):
        return [torch.tensor(v, dtype=torch.float64).reshape(s).requires_grad_()
                for v, s in zip(self.init, self.shapes)]

    def loss(self, params):
        W1, b1, W2, b2 = params
        y = torch.tanh(self.X @ W1.t() + b1) @ W2.t() + b2
        return ((y - self.Y) ** 2).mean()

    def follow(self, opt, params) -> float:
        """Steps `opt` (over `params`, made by self.params()) through the file's protocol
        and returns the largest deviation from the trajectory, loss and parameters."""
        worst = 0.0
        for ref in self.steps:
            take_step(opt, lambda: self.loss(params), self.closure)
            with torch.no_grad():
                got = [self.loss(params).reshape(1)] + [p.detach().reshape(-1) for p in params]
                want = [torch.tensor([ref["loss"]], dtype=torch.float64)] + [
                    torch.tensor(v, dtype=torch.float64) for v in ref["params"]]
                for g, w in zip(got, want):
                    worst = max(worst, deviation(g, w))
        return worst
