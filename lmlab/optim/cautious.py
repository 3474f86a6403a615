"""Cautious weight decay (Chen et al., 2025, "Cautious Weight Decay"; modded-nanogpt's Muon): decay an entry only where
the optimizer's update and the parameter agree in sign, i.e. where the step already shrinks |θ|:

    θ ← θ − lr·u − lr·wd·θ·1[u·θ > 0]          (u: the optimizer's own step direction, θ − lr·u its update)

instead of decoupled decay's θ ← θ − lr·u − lr·wd·θ everywhere. `cautious_step(opt, step)` wraps any optimizer whose
decay is decoupled (θ·(1 − lr·wd) before the update, torch's AdamW and Muon): it runs the step with no decay on the
groups marked `cautious`, reads u's sign from the change it made (θ₀ − θ₁ = lr·u), and applies the masked decay with
the group's lr and weight_decay at this step. Costs one copy of the decayed parameters for the step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


@torch.no_grad()
def cautious_step(opt: torch.optim.Optimizer, step: Callable[[], object]) -> object:
    """Run `step()` (the optimizer's own, decay off) and decay the `cautious` groups only where update and θ agree."""
    held = []
    for group in opt.param_groups:
        if group.get("cautious") and group["weight_decay"]:
            params = [p for p in group["params"] if p.grad is not None]
            held.append((group, group["weight_decay"], params, [p.detach().clone() for p in params]))
            group["weight_decay"] = 0.0
    try:
        out = step()
    finally:
        for group, wd, _, _ in held:
            group["weight_decay"] = wd
    for group, wd, params, before in held:
        for p, p0 in zip(params, before):
            agree = (p0 - p) * p0 > 0  # the update −lr·u moves θ toward 0: sign(u) = sign(θ)
            p.sub_(p0 * agree, alpha=group["lr"] * wd)
    return out


class CautiousAdamW(torch.optim.AdamW):
    """torch's AdamW with its decay made cautious on the groups marked `cautious` (all of them by default)."""

    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        cautious_step(self, super().step)
        return loss
