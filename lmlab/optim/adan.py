"""Adan (Xie et al. 2022, "Adan: Adaptive Nesterov Momentum Algorithm for Faster Optimizing Deep Models"): Adam's
moments plus a moving average of the gradient's change, which stands in for Nesterov's look-ahead gradient without a
second forward pass. With g_k the gradient, Δ_k = g_k − g_{k−1} (0 at the first step):

    m_k = β1·m + (1 − β1)·g_k
    v_k = β2·v + (1 − β2)·Δ_k
    n_k = β3·n + (1 − β3)·(g_k + β2·Δ_k)²
    θ ← θ·(1 − lr·wd) − lr·(m̂_k + β2·v̂_k) / (√n̂_k + ε)        (x̂: x / (1 − β^k), each moment its own β)

The decay is decoupled, as AdamW's (lr·wd on the matrices `param_groups` decays). The defaults are the paper's
(β = 0.98, 0.92, 0.99 in this convention: its β1 = 0.02 is our 1 − β1).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

import torch

from lmlab.optim.capabilities import declare
from lmlab.optim.elementwise import Elementwise
from lmlab.registry import PositiveFloat, Range

Betas3 = Annotated[tuple[float, float, float], Range(ge=0, lt=1)]


class Adan(Elementwise):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float, float] = (0.98, 0.92, 0.99),
                 eps: float = 1e-8, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        b1, b2, b3 = group["betas"]
        if not state:
            state["step"] = 0
            for key in ("m", "v", "n"):
                state[key] = torch.zeros_like(g)
            state["prev_grad"] = g.clone()
        state["step"] += 1
        k = state["step"]
        diff = g - state["prev_grad"]
        state["m"].mul_(b1).add_(g, alpha=1 - b1)
        state["v"].mul_(b2).add_(diff, alpha=1 - b2)
        ahead = g + b2 * diff  # the look-ahead gradient the second moment is of
        state["n"].mul_(b3).addcmul_(ahead, ahead, value=1 - b3)
        state["prev_grad"].copy_(g)
        denom = (state["n"] / (1 - b3 ** k)).sqrt_().add_(group["eps"])
        update = (state["m"] / (1 - b1 ** k) + b2 * state["v"] / (1 - b2 ** k)).div_(denom)
        p.mul_(1 - group["lr"] * group["weight_decay"])
        p.add_(update.to(p.dtype), alpha=-group["lr"])


def adan(groups: Iterable[dict], *, lr: PositiveFloat = 1e-3, betas: Betas3 = (0.98, 0.92, 0.99),
         eps: PositiveFloat = 1e-8) -> Adan:
    """Adan: Adam's moments and the averaged gradient change (Nesterov's look-ahead), decoupled decay."""
    return Adan(groups, lr=lr, betas=tuple(betas), eps=eps)


declare(adan, mup=True)  # an entrywise-normalised update, as Adam's: µP's per-group rates apply
OPTION = adan
