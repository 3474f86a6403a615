"""LAMB (You et al., 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76 minutes", Algorithm 2):
Adam's direction plus decay, rescaled per tensor by a trust ratio, so each tensor moves by about lr·‖θ‖ whatever its
gradients' scale. Per tensor θ (t = 1, 2, ...):

    m ← β1·m + (1 − β1)·g;   v ← β2·v + (1 − β2)·g²;   m̂ = m / (1 − β1ᵗ);   v̂ = v / (1 − β2ᵗ)
    r = m̂ / (√v̂ + ε) + wd·θ
    θ ← θ − lr · φ(‖θ‖) / ‖r‖ · r,   φ(x) = min(x, max_trust_norm) (identity when null)

with ratio 1 where ‖θ‖ or ‖r‖ is 0 (a zero-initialised bias takes Adam's step). The decay sits inside the trust
ratio, so it is not decoupled: a zero-gradient step on a decayed tensor gives θ·(1 − lr), not θ·(1 − lr·wd).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class LAMB(torch.optim.Optimizer):
    def __init__(self, params: Iterable, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, max_trust_norm: float | None = None) -> None:
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0,
                                  "max_trust_norm": max_trust_norm})

    @staticmethod
    def trust_ratio(p: torch.Tensor, r: torch.Tensor, max_trust_norm: float | None = None) -> torch.Tensor:
        """φ(‖θ‖)/‖r‖, or 1 where either norm is 0."""
        w, n = p.norm(), r.norm()
        if max_trust_norm is not None:
            w = w.clamp(max=max_trust_norm)
        return torch.where((w > 0) & (n > 0), w / n, torch.ones_like(w))

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                dtype = torch.promote_types(p.dtype, torch.float32)  # fp32 at least (bf16 weights), fp64 kept
                g = p.grad.to(dtype)
                st = self.state[p]
                if not st:
                    st.update(step=torch.zeros(()), exp_avg=torch.zeros_like(g), exp_avg_sq=torch.zeros_like(g))
                st["step"] += 1
                t = float(st["step"])
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                m_hat = st["exp_avg"] / (1 - b1 ** t)
                v_hat = st["exp_avg_sq"] / (1 - b2 ** t)
                r = m_hat / (v_hat.sqrt() + group["eps"]) + group["weight_decay"] * p.to(dtype)
                ratio = self.trust_ratio(p.to(dtype), r, group["max_trust_norm"])
                p.sub_((r * (group["lr"] * ratio)).to(p.dtype))
        return loss
