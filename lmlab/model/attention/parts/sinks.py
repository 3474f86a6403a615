"""attention.sinks: a learned sink logit per head (gpt-oss; Xiao et al., 2024's attention sinks, learned): the
softmax normalises over the keys and the sink, whose weight reads no value. A column of the softmax: softmax scores
only, explicit; its logit 0 at init (e^0 beside the keys')."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.model.attention.parts import Part, Widths

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class Sinks(Part):
    rank = 2
    requires = {"score": (("softmax",), "a sink is a column of the softmax")}

    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, sinks: bool = False) -> None:
        attn.sink = nn.Parameter(torch.zeros(attn.n_head))

    @classmethod
    def n_params(cls, cfg: GPTConfig, widths: Widths, **keys: Any) -> int:
        return widths.heads

    def extras(self, attn: nn.Module, x: torch.Tensor, cache: Any) -> dict[str, Any]:
        return {"sink": attn.sink}


PARTS = {"sinks": Sinks}
