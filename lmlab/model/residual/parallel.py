"""`residual=parallel`: the sublayers of a block read the same input and their branches are summed (GPT-J, GPT-NeoX,
PaLM): x + F_attn(N_1(x)) + F_ffn(N_2(x)) under pre-norm, instead of feeding the FFN the stream after attention. Needs
a placement that adds each branch to the stream (pre, double, post_nonres; refused for post and deepnorm, which
normalise the sum) and a block of several sublayers (refused for block=gau)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.placement import Block, Sublayer


class Summed:
    """The wiring: x + Σ_j t(branch_j(x)), every branch from the block's input."""

    def wire(self, block: Block, x: torch.Tensor, fs: list[tuple[int, Sublayer]]) -> torch.Tensor:
        out = x
        for j, f in fs:
            out = out + block.transform(j, block.branch(x, f, j))
        return out


class Parallel(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.block.get("name", "transformer") != "transformer":
            raise ValueError(f"residual=parallel sums a block's sublayers: block={cfg.block['name']!r} has one; use "
                             f"block=transformer")

    def attach(self, model: nn.Module) -> None:
        for block in model.h:
            if not block.additive:
                raise ValueError(f"residual=parallel sums the sublayers' branches: placement="
                                 f"{model.cfg.placement['name']!r} normalises the sum; use placement=pre|double|"
                                 f"post_nonres")
            block.set_wiring("parallel", Summed(), "parallel")


OPTIONS = {"parallel": Parallel}
