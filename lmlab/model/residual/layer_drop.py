"""`residual=layer_drop`: stochastic depth (Huang et al., 2016, "Deep Networks with Stochastic Depth"; in transformers
as timm's DropPath and Fan et al.'s LayerDrop, 2019). While training, each sublayer's branch is dropped for each
sequence of the batch with probability p_l and scaled by 1/(1 − p_l) where kept, so its expectation is the branch
itself; in evaluation every branch is kept, unscaled: the model is the standard one. With `linear` (Huang et al.'s
rule) p_l = rate·(l + 1)/L for the 0-based layer l of L, the last layer dropped most; otherwise p_l = rate everywhere.
Under post and deepnorm the drop acts on F(x) inside the norm, N(x + m·F(x)/(1 − p)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import torch
from torch import nn

from lmlab.registry import Range

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class DropBranch(nn.Module):
    """One block's drop, probability `p`: y·m/(1 − p), m ~ Bernoulli(1 − p) per sequence, while training."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, j: int, y: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return y
        keep = 1.0 - self.p
        mask = torch.empty((y.size(0),) + (1,) * (y.dim() - 1), device=y.device, dtype=y.dtype).bernoulli_(keep)
        return y * mask / keep

    def extra_repr(self) -> str:
        return f"p={self.p:g}"


class LayerDrop(nn.Module):
    def __init__(self, cfg: GPTConfig, *, rate: Annotated[float, Range(ge=0, lt=1)] = 0.1,
                 linear: bool = True) -> None:
        super().__init__()
        self.rates = [rate * (i + 1) / cfg.n_layer if linear else rate for i in range(cfg.n_layer)]

    def attach(self, model: nn.Module) -> None:
        for block, p in zip(model.h, self.rates):
            block.add_transform("layer_drop", DropBranch(p))


OPTIONS = {"layer_drop": LayerDrop}
