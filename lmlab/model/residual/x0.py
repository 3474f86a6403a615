"""`residual=x0`: the embedding output re-injected into every layer's input, x ← x + λ_l·x0 for l ≥ 1, λ_l learned
(init `init`, 0: the standard stream at step 0), as the GPT-2 speedrun does (`x = λ·x + λ₀·x0`, with
`residual=scaled stream=true` for the first factor)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class X0(nn.Module):
    def __init__(self, cfg: GPTConfig, *, init: float = 0.0) -> None:
        super().__init__()
        self.lambdas = nn.Parameter(torch.full((cfg.n_layer,), float(init)))
        self.x0: torch.Tensor | None = None

    def start(self, x0: torch.Tensor, idx: torch.Tensor) -> None:
        self.x0 = x0

    def before(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x if i == 0 else x + self.lambdas[i].to(x.dtype) * self.x0


OPTIONS = {"x0": X0}
