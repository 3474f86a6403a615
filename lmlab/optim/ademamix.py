"""AdEMAMix (Pagliardini, Ablin & Grangier 2024, "The AdEMAMix Optimizer: Better, Faster, Older"): Adam with a second,
slow exponential moving average of the gradient mixed into the numerator, so that gradients thousands of steps old
still move the weights. With g_t the gradient at step t (1-based):

    m1 = β1·m1 + (1 − β1)·g        (the fast EMA, bias-corrected: m̂1 = m1 / (1 − β1^t))
    m2 = β3·m2 + (1 − β3)·g        (the slow EMA, not bias-corrected)
    v  = β2·v  + (1 − β2)·g²       (v̂ = v / (1 − β2^t))
    θ ← θ·(1 − lr·wd) − lr·(m̂1 + α·m2) / (√v̂ + ε)

A slow EMA of β3 = 0.9999 from the first step destabilises early training, so the paper warms α and β3 up over
`warmup_steps` T (its T_α = T_β3; 0: none): α_t = min(t·α/T, α) and β3_t = min(exp(ln β1·ln β3 / ((1 − t/T)·ln β3 +
(t/T)·ln β1)), β3), which goes from β1 at t = 0 to β3 at t = T with the half-life growing linearly. The paper's
defaults: β = (0.9, 0.999, 0.9999), α = 5..8, T the whole run. The decay is decoupled, as AdamW's (lr·wd on the matrices
`param_groups` decays).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated

import torch

from lmlab.optim.capabilities import declare
from lmlab.optim.elementwise import Elementwise
from lmlab.registry import NonNegativeFloat, NonNegativeInt, PositiveFloat, Range

Betas3 = Annotated[tuple[float, float, float], Range(ge=0, lt=1)]


def warmed(t: int, alpha: float, beta1: float, beta3: float, warmup: int) -> tuple[float, float]:
    """(α_t, β3_t) at step t of the paper's schedulers (warmup 0: α and β3 from the first step)."""
    if warmup <= 0 or t >= warmup:
        return alpha, beta3
    frac = t / warmup
    ln1, ln3 = math.log(beta1), math.log(beta3)
    return min(t * alpha / warmup, alpha), min(math.exp(ln1 * ln3 / ((1 - frac) * ln3 + frac * ln1)), beta3)


class AdEMAMix(Elementwise):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float, float] = (0.9, 0.999, 0.9999),
                 alpha: float = 5.0, warmup_steps: int = 0, eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), alpha=alpha, warmup_steps=warmup_steps, eps=eps,
                                      weight_decay=weight_decay))

    def update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        b1, b2, b3 = group["betas"]
        if not state:
            state["step"] = 0
            for key in ("m1", "m2", "v"):
                state[key] = torch.zeros_like(g)
        state["step"] += 1
        t = state["step"]
        alpha, beta3 = warmed(t, group["alpha"], b1, b3, group["warmup_steps"])
        state["m1"].mul_(b1).add_(g, alpha=1 - b1)
        state["m2"].mul_(beta3).add_(g, alpha=1 - beta3)
        state["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
        denom = (state["v"] / (1 - b2 ** t)).sqrt_().add_(group["eps"])
        update = (state["m1"] / (1 - b1 ** t)).add_(state["m2"], alpha=alpha).div_(denom)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"])


def ademamix(groups: Iterable[dict], *, lr: PositiveFloat = 1e-3, betas: Betas3 = (0.9, 0.999, 0.9999),
             alpha: NonNegativeFloat = 5.0, warmup_steps: NonNegativeInt = 0, eps: PositiveFloat = 1e-8) -> AdEMAMix:
    """AdEMAMix: Adam plus a slow EMA of the gradient (β3, weight α), both warmed up over `warmup_steps`."""
    return AdEMAMix(groups, lr=lr, betas=tuple(betas), alpha=alpha, warmup_steps=warmup_steps, eps=eps)


declare(ademamix, mup=True)  # an entrywise-normalised update, as Adam's: µP's per-group rates apply
OPTION = ademamix
