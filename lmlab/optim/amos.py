"""optim=amos: Amos (Tian & Parikh, 2022), Adam-style steps with a model-oriented scale per tensor and decays that
adapt to the run."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated, Literal

import torch

from lmlab.registry import NonNegativeFloat, PositiveFloat, Range

AmosSlots = Literal["row", "tensor", "element"]


class Amos(torch.optim.Optimizer):
    """Amos (Tian & Parikh, 2022, arXiv 2210.11693, Algorithm 1; checked against the authors' jestimator `amos.py`):
    Adam-style steps of size ξ·η̃ per tensor, with a weight decay and decay factors that adapt to the run instead of
    a schedule. With ξ = lr (the global rate, scaled by the schedule), g the gradient, and per slot (see `slots`):

        v ← β·v + (1−β)·M₂(g);   v̂ = max(v, ε) / (1 − β^t)               (M₂: mean of g² over the slot)
        c_t = (1 + c·√ξ·b)^(−½);   d_t = 1 / (1 + d·√(ξ·η̃)·b)           (decay factors, from the accumulator b)
        γ_t = c_t·ξ²·M₂(g) / v̂                                           (adaptive weight decay)
        u = −d_t·(ξ·η̃·g/√v̂ + (½·γ_t + ξ·wd)·θ);   b ← b + γ_t·(1 + b)
        θ ← θ + u, or with `momentum` μ > 0: m ← μ·m + (1−μ)·u, θ ← θ + m

    η̃ is the model-oriented scale, the magnitude the tensor is expected to have (`scale()`): 1/√fan_in for a
    matrix (fan_in = its last dim, torch's (out, in) layout: the scale of a unit-variance-preserving init) and
    `vector_scale` for biases and norm gains. `slots` is the paper's memory reduction, the shape of v and b:
    `row` (the authors' BERT/T5 recipe: one per output row of a matrix, i.e. M₂ over its input dim, one per token
    of an embedding; one per vector), `tensor` (one per tensor) or `element` (jestimator's default: one per entry,
    as Adam). The group's `weight_decay` wd is an extra decay ξ·wd·θ, lr times wd as for every lmlab optimizer (the
    reference's `extra_l2` = ξ·wd; 0 in amos.yaml).
    """

    def __init__(self, params: Iterable, lr: float = 0.01, beta: float = 0.999, c: float = 0.25, d: float = 0.25,
                 eps: float = 2.0 ** -125, vector_scale: float = 0.5, slots: AmosSlots = "row",
                 momentum: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "beta": beta, "c": c, "d": d, "eps": eps, "vector_scale": vector_scale,
                                  "slots": slots, "momentum": momentum, "weight_decay": 0.0})

    @staticmethod
    def scale(p: torch.Tensor, vector_scale: float = 0.5) -> float:
        """η̃: 1/√fan_in for a matrix (fan_in = the last dim), `vector_scale` for a vector or a scalar."""
        return p.shape[-1] ** -0.5 if p.dim() >= 2 else vector_scale

    @staticmethod
    def mean_square(g: torch.Tensor, slots: str) -> torch.Tensor:
        """M₂(g): g² averaged over each slot (the shape of v and b)."""
        if slots == "element":
            return g.square()
        if slots == "row" and g.dim() >= 2:
            return g.square().mean(dim=-1, keepdim=True)
        return g.square().mean()

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for group in self.param_groups:
            xi, beta, c, d, mu = group["lr"], group["beta"], group["c"], group["d"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad.float()
                m2 = self.mean_square(g, group["slots"])
                st = self.state[p]
                if not st:
                    st.update(step=torch.zeros((), device=p.device), v=torch.zeros_like(m2), b=torch.zeros_like(m2))
                    if mu > 0:
                        st["m"] = torch.zeros_like(g)
                st["step"] += 1
                eta, b = self.scale(p, group["vector_scale"]), st["b"]
                st["v"].mul_(beta).add_(m2 * (1 - beta))
                v_hat = st["v"].clamp_min(group["eps"]) / (1 - beta ** st["step"])
                c_t = (1 + c * math.sqrt(xi) * b).rsqrt()
                d_t = 1 / (1 + d * math.sqrt(xi * eta) * b)
                gamma = c_t * xi ** 2 * m2 / v_hat
                update = -d_t * (g * (xi * eta / v_hat.sqrt()) + (0.5 * gamma + xi * group["weight_decay"]) * p.float())
                if mu > 0:
                    update = st["m"].mul_(mu).add_(update * (1 - mu))
                p.add_(update.to(p.dtype))
                b.add_(gamma * (1 + b))
        return loss


def amos(groups: Iterable[dict], *, lr: PositiveFloat = 0.01, beta: Annotated[float, Range(ge=0, lt=1)] = 0.999,
         c: NonNegativeFloat = 0.25, d: NonNegativeFloat = 0.25, eps: PositiveFloat = 2.0 ** -125,
         vector_scale: PositiveFloat = 0.5, slots: AmosSlots = "row",
         momentum: Annotated[float, Range(ge=0, lt=1)] = 0.0) -> Amos:
    """Amos; `lr` is the paper's global rate ξ, `vector_scale` the η̃ of biases and norm gains (see `Amos`)."""
    return Amos(groups, lr=lr, beta=beta, c=c, d=d, eps=eps, vector_scale=vector_scale, slots=slots, momentum=momentum)

OPTION = amos
