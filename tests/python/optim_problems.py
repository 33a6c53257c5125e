"""The small training problem and helpers the tidepool.optim tests share (test_optim.py,
test_optim_in_training_loops.py)."""

from __future__ import annotations

import torch


def regression_problem(dtype=torch.float32, seed=0, groups=1):
    """A small least-squares problem with parameters in `groups` groups."""
    gen = torch.Generator().manual_seed(seed)
    X = torch.randn(64, 12, generator=gen, dtype=dtype)
    Y = torch.randn(64, 3, generator=gen, dtype=dtype)
    W = torch.randn(3, 12, generator=gen, dtype=dtype).requires_grad_()
    b = torch.randn(3, generator=gen, dtype=dtype).requires_grad_()

    def loss():
        return ((X @ W.t() + b - Y) ** 2).mean()
    params = [W, b] if groups == 1 else [{"params": [W]}, {"params": [b], "lr": 0.02}]
    return params, [W, b], loss


def train(opt, loss, steps):
    for _ in range(steps):
        opt.zero_grad()
        loss().backward()
        opt.step()


def snapshot(tensors):
    return [t.detach().clone() for t in tensors]


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y), (x - y).abs().max()
