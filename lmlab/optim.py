"""Optimizers and learning-rate schedules, one dict each.

Optimizer contract: `opt(param_groups, *, <own params>) -> torch.optim.Optimizer`; `param_groups` puts
weight decay only on matrices that are not embeddings (no decay on norms, biases, embeddings), the split
GPT-2/nanoGPT use. `grad_clip` in the `optim` config is read by the training loop, not the optimizer.
Schedule contract: `sched(step, max_steps, *, warmup_steps, <own params>) -> lr multiplier`; every schedule
warms up linearly over `warmup_steps` (0 = no warmup, the condition of the stability studies).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated

import torch
from torch import nn

from lmlab.registry import Fraction, NonNegativeFloat, NonNegativeInt, PositiveFloat, Range

Betas = Annotated[tuple[float, float], Range(ge=0, lt=1)]  # moving-average coefficients, each in [0, 1)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights of Linear layers; never norms, biases or embedding tables (tied heads included)."""
    no_decay = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, rest = [], []
    for p in {id(p): p for p in model.parameters() if p.requires_grad}.values():
        (decay if p.dim() >= 2 and id(p) not in no_decay else rest).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def adamw(groups: Iterable[dict], *, lr: PositiveFloat = 1e-3, betas: Betas = (0.9, 0.95), eps: PositiveFloat = 1e-8,
          fused: bool | None = None) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter, 2019), decoupled weight decay.

    fused=None (auto) takes torch's fused kernel when every parameter is a float tensor on CPU or CUDA: the same
    update in one pass per tensor, ~3x faster than torch's default loop on CPU (measured: 17 vs 51 ms for 12M
    parameters, one thread); fused=false keeps torch's default implementation.
    """
    groups = list(groups)
    if fused is None:
        params = [p for g in groups for p in g["params"]]
        fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused or None)


def sgd(groups: Iterable[dict], *, lr: PositiveFloat = 0.1, momentum: NonNegativeFloat = 0.9, nesterov: bool = False
        ) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)


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


def _warmup(step: int, warmup_steps: int) -> float | None:
    return (step + 1) / warmup_steps if step < warmup_steps else None


def constant(step: int, max_steps: int, *, warmup_steps: NonNegativeInt = 0) -> float:
    return _warmup(step, warmup_steps) or 1.0


def cosine(step: int, max_steps: int, *, warmup_steps: NonNegativeInt = 0, min_lr_ratio: Fraction = 0.1) -> float:
    """Linear warmup, then a half cosine from 1 down to min_lr_ratio at max_steps."""
    if (w := _warmup(step, warmup_steps)) is not None:
        return w
    t = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def linear(step: int, max_steps: int, *, warmup_steps: NonNegativeInt = 0, min_lr_ratio: Fraction = 0.0) -> float:
    """Linear warmup, then linear decay to min_lr_ratio at max_steps."""
    if (w := _warmup(step, warmup_steps)) is not None:
        return w
    t = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return 1 - (1 - min_lr_ratio) * t


def wsd(step: int, max_steps: int, *, warmup_steps: NonNegativeInt = 0, decay_frac: Fraction = 0.2,
        min_lr_ratio: Fraction = 0.0) -> float:
    """Warmup-stable-decay (Hu et al., 2024, MiniCPM): constant after warmup, then a linear cool-down over the
    last `decay_frac` of training."""
    if (w := _warmup(step, warmup_steps)) is not None:
        return w
    decay_start = max_steps - int(decay_frac * max_steps)
    if step < decay_start:
        return 1.0
    t = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
    return 1 - (1 - min_lr_ratio) * t


OPTIMIZERS = {"adamw": adamw, "sgd": sgd, "lion": lion}
SCHEDULES = {"cosine": cosine, "linear": linear, "constant": constant, "wsd": wsd}
