"""optim=lion: Lion (Chen et al., 2023, "Symbolic Discovery of Optimization Algorithms"), the sign of an
interpolated momentum as the update."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from lmlab.optim.capabilities import declare
from lmlab.registry import Betas, PositiveFloat


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al., 2023): update = sign(β1·m + (1−β1)·g); m ← β2·m + (1−β2)·g; decoupled decay."""

    def __init__(self, params: Iterable, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99)) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": 0.0})

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)
        return loss


def lion(groups: Iterable[dict], *, lr: PositiveFloat = 1e-4, betas: Betas = (0.9, 0.99)) -> Lion:
    return Lion(groups, lr=lr, betas=betas)


declare(lion, mup=True)  # a sign update: entrywise like Adam's

OPTION = lion
