"""PerParameter: the shape the test suite's hand-written optimizers share (a stand-in for
the published Apollo in reference_apollo.py, and optimizers that keep their state in
ways the drop-in must handle in test_stray_state.py and test_optim_hooks_random.py)."""

from __future__ import annotations

import torch


class PerParameter(torch.optim.Optimizer):
    """step(closure) calls the closure with grad mode on (and returns its loss), then
    update(group, p), with grad mode off, for each parameter that has a gradient."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.update(group, p)
        return loss

    def update(self, group, p) -> None:
        raise NotImplementedError
