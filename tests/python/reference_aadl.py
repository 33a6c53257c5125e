"""AADL written out from DESIGN.md ("optimizers/", after the published reference ORNL/AADL
@9765262) in plain tensor operations: the history as a deque of flattened parameter
vectors per group, stacked into X at each acceleration, DX, DR and the solve formed from X
directly. A value partner for tidepool.optim.AADL on the options the golden trajectories
do not reach (store_each_nth > 1, reg_acc > 0, Adam and RMSprop inside, several groups),
itself checked against the golden trajectories (test_aadl_reference.py).

tidepool's AADL shares none of this: it keeps the Gram matrix of DR up to date one column
at a time, streams the history from wherever it lives, and writes the extrapolation as a
sum of differences. What the two share is the definition of γ where DR is nearly rank
deficient: the minimum-norm solution of the column-equilibrated normal equations, with
singular values below RCOND of the largest cut (the published code leaves that case to
whichever LAPACK driver torch picks, so no finer reference exists)."""

from __future__ import annotations

from collections import deque

import torch
from torch.nn.utils import parameters_to_vector

RCOND = 1e-13


def load(x: torch.Tensor, params) -> None:
    """Copies x into the parameters. (torch's vector_to_parameters would make them views
    of x, and the inner optimizer's in-place updates would then change x where the history
    keeps it.)"""
    offset = 0
    for p in params:
        p.copy_(x[offset:offset + p.numel()].view_as(p))
        offset += p.numel()


def extrapolate(X: torch.Tensor, relaxation: float, reg: float) -> torch.Tensor:
    """The accelerated iterate from the history X (columns oldest to newest, ≥ 3)."""
    DX = X[:, 1:] - X[:, :-1]
    DR = DX[:, 1:] - DX[:, :-1]
    b = DX[:, -1]
    gram = DR.t() @ DR + reg * torch.eye(DR.shape[1], dtype=X.dtype)
    scale = gram.diagonal().sqrt()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = gram / scale.unsqueeze(1) / scale.unsqueeze(0)
    rhs = (DR.t() @ b) / scale
    y = torch.linalg.lstsq(scaled, rhs.unsqueeze(1), rcond=RCOND, driver="gelsd").solution
    gamma = y.squeeze(1) / scale
    x = X[:, -2] + b - (DX[:, :-1] + DR) @ gamma
    if relaxation == 1.0:
        return x
    alpha = torch.zeros(gamma.numel() + 1, dtype=X.dtype)
    alpha[0] = gamma[0]
    alpha[1:-1] = gamma[1:] - gamma[:-1]
    alpha[-1] = 1.0 - gamma[-1]
    return relaxation * x + (1.0 - relaxation) * (X[:, :-1] @ alpha)


class ReferenceAADL:
    """Wraps `inner`; step(closure) steps it, then stores and accelerates as the reference.

    Both acceleration types solve the same least-squares problem (they differ only in the
    published code's choice of solver), so acceleration_type is accepted and not used."""

    def __init__(self, inner: torch.optim.Optimizer, acceleration_type: str = "anderson",
                 relaxation: float = 0.1, wait_iterations: int = 1, history_depth: int = 15,
                 store_each_nth: int = 1, frequency: int = 1, reg_acc: float = 0.0):
        assert acceleration_type in ("anderson", "anderson_normal_equation")
        self.inner = inner
        self.relaxation = relaxation
        self.wait_iterations = wait_iterations
        self.store_each_nth = store_each_nth
        self.frequency = frequency
        self.reg_acc = reg_acc
        self.history = [deque(maxlen=history_depth) for _ in inner.param_groups]
        self.calls = 0
        self.since_store = 0
        self.accepted = 0
        self.rejected = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def history_size(self, group: int = 0) -> int:
        return len(self.history[group])

    def step(self, closure=None):
        loss = self.inner.step(closure)
        self.since_store += 1
        stores = self.since_store >= self.store_each_nth
        if stores:
            self.since_store = 0
        self.calls += 1
        accelerates = self.calls > self.wait_iterations and self.calls % self.frequency == 0
        with torch.no_grad():
            for group, history in zip(self.inner.param_groups, self.history):
                params = group["params"]
                if stores:
                    history.append(parameters_to_vector(params).clone())
                if not accelerates or len(history) < 3:
                    continue
                x = extrapolate(torch.stack(list(history), dim=1), self.relaxation,
                                self.reg_acc)
                if closure is None:
                    load(x, params)
                    continue
                # The safeguard: the loss at the plain iterate against the loss at x.
                plain = parameters_to_vector(params).clone()
                plain_loss = float(closure())
                load(x, params)
                if float(closure()) < plain_loss:
                    history.pop()
                    history.append(x)
                    self.accepted += 1
                else:
                    # DESIGN.md: the plain iterate (where the published code reloads the
                    # newest stored vector; optimizers/aadl.h says when they differ).
                    load(plain, params)
                    self.rejected += 1
        return loss
