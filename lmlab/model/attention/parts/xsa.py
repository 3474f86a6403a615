"""attention.xsa: exclusive self-attention (arXiv 2603.09078; the GPT-2 speedrun's record 82, gated).

Each head's output y_i (the values weighed) loses its component along the token's own value direction,
v̂_i = v_i / ‖v_i‖:  y_i ← y_i − α_h·(y_i·v̂_i)·v̂_i,  so a head passes on what the context adds beyond the token itself
(which the residual stream carries already). `full`: α_h = 1, the paper's XSA; `gated`: α_h = tanh(a_h) with a
learnt a_h per head from 0, the record's (the standard model at step 0; a 1-D weight: the `rest` role, AdamW
without decay, as the record's Adam). The own value is the value the head read at the token's position (after value
mixes: value embeddings, value residual); under GQA/MQA a query head's is its key/value head's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.attention.parts import Part

if TYPE_CHECKING:
    from lmlab.config import GPTConfig

XSA = Literal["gated", "full"]


class ExclusiveSelfAttention(nn.Module):
    """y (B, nh, T, dv), v (B, nkv, S, dv) whose last T rows are these queries' own values -> y without its share
    along them."""

    def __init__(self, kind: XSA, n_head: int) -> None:
        super().__init__()
        self.kind = kind
        self.alpha = nn.Parameter(torch.zeros(n_head)) if kind == "gated" else None  # a_h: tanh(0) = 0 at init

    def forward(self, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        nh, T = y.size(1), y.size(-2)
        own = v[..., v.size(-2) - T:, :].repeat_interleave(nh // v.size(1), dim=1)  # (B, nh, T, dv)
        unit = F.normalize(own, dim=-1, eps=1e-4)  # the record's eps: a zero value removes nothing
        share = (y * unit).sum(-1, keepdim=True)
        if self.alpha is None:
            return y - share * unit
        return y - torch.tanh(self.alpha).to(y.dtype).view(1, nh, 1, 1) * share * unit


class XSAPart(Part):
    rank = 6

    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, xsa: XSA | None = None) -> None:
        attn.xsa = ExclusiveSelfAttention(xsa, attn.n_head)

    def weighed(self, attn: nn.Module, y: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return attn.xsa(y, v)


PARTS = {"xsa": XSAPart}
