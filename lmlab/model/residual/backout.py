"""`residual=backout`: before the final norm, a learned fraction of an earlier layer's stream is taken back out (the
GPT-2 speedrun's backout, record 40, 2025-10-04, @classiclarryd after @snimu's PR #138: what the first layers write
may serve the later layers' context without serving the prediction):

    x_L ← x_L − λ·x_{ℓ+1}        (x_{ℓ+1}: the stream after layer ℓ = `layer`; λ a learned scalar, init `init`)

x_{ℓ+1} is the whole stream there, the embedding included, as the record's `x_backout = x` after block ℓ, and
`x -= backout_lambda * x_backout` before `norm(x)` and the head. `layer: null` is ⌊2L/3⌋ (the record's: layer 8 of 12,
record 62's layer 7 of 11), at most L − 2; λ starts at 0.5 (the record's), a scalar: AdamW's no-decay group under
every optimizer (the record's is one of its Adam scalars)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.registry import NonNegativeInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class Backout(nn.Module):
    def __init__(self, cfg: GPTConfig, *, layer: NonNegativeInt | None = None, init: float = 0.5) -> None:
        super().__init__()
        L = self.n_layer = cfg.n_layer
        if L < 2:
            raise ValueError(f"residual=backout takes an earlier layer's stream out of the last one's: "
                             f"model.n_layer={L} has no layer before the last (>= 2 layers)")
        self.layer = min(2 * L // 3, L - 2) if layer is None else layer
        if self.layer > L - 2:
            raise ValueError(f"residual.backout.layer={layer} must be a layer before the last, 0 .. {L - 2} "
                             f"(model.n_layer={L}), or null for ⌊2L/3⌋")
        self.lam = nn.Parameter(torch.tensor(float(init)))
        self.saved: torch.Tensor | None = None

    def start(self, x0: torch.Tensor, idx: torch.Tensor) -> None:
        self.saved = None

    def after(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if i == self.layer:
            self.saved = x
        elif i == self.n_layer - 1:  # the stream the final norm reads
            x = x - self.lam.to(x.dtype) * self.saved
            self.saved = None
        return x


OPTIONS = {"backout": Backout}
