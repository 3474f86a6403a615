"""`residual=scaled`: learned scalars on the stream and on each sublayer's branch.

x ← λ_l·x at the input of layer l when `stream` (the GPT-2 speedrun's `resid_lambdas`, init `stream_init`: 1, or
the record 45's 1.1, which weighs the early layers' outputs up by 1.1^(L − l) at step 0), and each sublayer's
branch F scaled by a learned α (x + α·F(N(x)) under pre-norm): one per sublayer (`per_channel=false`: ReZero,
Bachlechner et al., 2020, with `branch_init=0` — the model is exactly the identity at step 0 — or a scalar at 1) or one
per channel
(`per_channel=true`: LayerScale, Touvron et al., 2021, `branch_init` ≈ 0.1). Under the placements that normalise the
sum (post, deepnorm) α scales F(x) inside the norm, N(x + α·F(x)); under the others it scales the branch after any
norm on it (double: x + α·N(F(N(x)))), where a norm would undo it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.registry import NonNegativeFloat

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class BranchScale(nn.Module):
    """α_j for each sublayer j of one block: (d_model,) per channel or a scalar."""

    def __init__(self, n_sublayers: int, d_model: int, init: float, per_channel: bool) -> None:
        super().__init__()
        shape = (n_sublayers, d_model) if per_channel else (n_sublayers, 1)
        self.alpha = nn.Parameter(torch.full(shape, float(init)))

    def forward(self, j: int, y: torch.Tensor) -> torch.Tensor:
        return y * self.alpha[j - 1].to(y.dtype)


class Scaled(nn.Module):
    def __init__(self, cfg: GPTConfig, *, branch_init: NonNegativeFloat = 1.0, per_channel: bool = False,
                 stream: bool = False, stream_init: float = 1.0) -> None:
        super().__init__()
        self.branch_init, self.per_channel, self.d_model = branch_init, per_channel, cfg.d_model
        if stream_init != 1.0 and not stream:
            raise ValueError(f"residual.scaled.stream_init={stream_init} starts the stream scalars λ_l, which "
                             f"residual.scaled.stream=false leaves out: set residual.scaled.stream=true")
        self.stream = nn.Parameter(torch.full((cfg.n_layer,), float(stream_init))) if stream else None

    def attach(self, model: nn.Module) -> None:
        for block in model.h:
            block.add_transform("branch_scale", BranchScale(len(block.sublayer_names), self.d_model,
                                                            self.branch_init, self.per_channel))

    def before(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x if self.stream is None else self.stream[i].to(x.dtype) * x


OPTIONS = {"scaled": Scaled}
