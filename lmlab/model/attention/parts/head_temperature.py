"""attention.head_temperature: a learned temperature per head. Head h's logits are multiplied by exp(s_h), s_h
learnt from 0 (the standard model at init), through its queries: q_h ← exp(s_h)·q_h, before the rotation (a scale
commutes with it) and after the q/k norm, whose fixed scale it frees (Henry et al., 2020, "Query-Key Normalization
for Transformers", learn one such scale g for the whole model; attention=cosine learns one per head on its cosines,
Swin V2's τ). A per-head scalar: the `rest` optimizer role, no weight decay."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.model.attention.parts import Part, Widths

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class HeadTemperature(Part):
    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, head_temperature: bool = False) -> None:
        attn.log_temperature = nn.Parameter(torch.zeros(attn.n_head))  # s_h: exp(0) = 1 at init

    @classmethod
    def n_params(cls, cfg: GPTConfig, widths: Widths, **keys: Any) -> int:
        return widths.heads

    def before_rotation(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q * attn.log_temperature.exp().to(q.dtype)[:, None, None], k  # q (B, nh, T, d)


PARTS = {"head_temperature": HeadTemperature}
