"""The step loop of an optimizer that updates each parameter from its own gradient and state (Adan, AdEMAMix): the
closure, the parameters with a gradient, moments in fp32 at least; each optimizer writes only its `update`."""

from __future__ import annotations

from typing import Any

import torch


class Elementwise(torch.optim.Optimizer):
    def update(self, p: torch.Tensor, g: torch.Tensor, state: dict[str, Any], group: dict[str, Any]) -> None:
        """Move `p` by its gradient `g` (fp32 at least) and its `state` (empty at the first step), under `group`."""
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):  # noqa: ANN001, ANN201  (torch's Optimizer.step signature)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.float() if p.grad.dtype in (torch.float16, torch.bfloat16) else p.grad
                    self.update(p, g, self.state[p], group)
        return loss
