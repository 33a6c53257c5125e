"""Apollo written out step by step from DESIGN.md ("optimizers/", after the published
reference XuezheMax/apollo optim/apollo.py @7adf28f) in plain tensor operations, with
its state in the reference's layout: a checkpoint test partner for tidepool.optim.Apollo
(test_optim.py), itself checked against the golden trajectories there."""

from __future__ import annotations

import torch

from per_parameter import PerParameter


class ReferenceApollo(PerParameter):
    def __init__(self, params, lr, beta=0.9, eps=1e-4, rebound="constant", warmup=500,
                 init_lr=None, weight_decay=0.0, weight_decay_type=None):
        if init_lr is None:
            init_lr = lr / 1000
        if weight_decay_type is None:
            weight_decay_type = "L2" if rebound == "constant" else "decoupled"
        super().__init__(params, dict(lr=lr, beta=beta, eps=eps, rebound=rebound,
                                      warmup=warmup, init_lr=init_lr, base_lr=lr,
                                      weight_decay=weight_decay,
                                      weight_decay_type=weight_decay_type))

    def update(self, group, p) -> None:
        state = self.state[p]
        if not state:
            state["step"] = 0
            for key in ("exp_avg_grad", "approx_hessian", "update"):
                state[key] = p.new_zeros(p.shape)
        k = state["step"]
        if k < group["warmup"]:  # 1.
            lr = group["init_lr"] + (group["base_lr"] - group["init_lr"]) * k / group["warmup"]
        else:
            lr = group["lr"]
        wd, wd_type = group["weight_decay"], group["weight_decay_type"]
        g = p.grad
        if wd != 0 and wd_type == "L2":  # 2.
            g = g + wd * p
        beta = group["beta"]  # 3.
        alpha = (1 - beta) / (1 - beta ** (k + 1))
        m, B, d = state["exp_avg_grad"], state["approx_hessian"], state["update"]
        delta = g - m
        if group["rebound"] == "constant":
            sigma, eps = 0.01, group["eps"] / 0.01
        else:
            sigma, eps = delta.abs().max(), group["eps"]
        m.add_(delta, alpha=alpha)  # 4.
        # 5. (a norm, as the reference takes it: in fp32 for half-precision tensors)
        s = torch.linalg.vector_norm(d, 4) + eps
        d.div_(s)
        v = d * d
        Delta = -alpha * ((delta / s) * d).sum() - (B * v).sum()  # 6.
        B.add_(Delta * v)
        if group["rebound"] == "constant":  # 7.
            D = B.abs().clamp(min=0.01)
        else:
            D = B.abs().maximum(sigma) + eps / alpha
        d.copy_(m / D)  # 8.
        if wd != 0 and wd_type == "decoupled":
            d.add_(p, alpha=wd)
        elif wd != 0 and wd_type == "stable":
            d.add_(p, alpha=wd / D.mean().item())
        p.sub_(lr * d)  # 9.
        state["step"] = k + 1
