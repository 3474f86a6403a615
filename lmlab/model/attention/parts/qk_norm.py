"""attention.qk_norm: RMS-normalise q and k per head before the dot product (Dehghani et al., 2023), bounding the
logits; `qk_norm_eps` its epsilon (null: torch's default, the dtype's machine epsilon; Qwen3 uses its rms_norm_eps).
Memory keys (attention.mem_kv) are normed as the tokens' keys are (x-transformers does the same)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.attention.parts import Part
from lmlab.registry import PositiveFloat

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class QKNorm(Part):
    rank = 3

    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, qk_norm: bool = False,
                 qk_norm_eps: PositiveFloat | None = None) -> None:
        if not qk_norm:
            raise ValueError(f"attention.qk_norm_eps={qk_norm_eps} needs attention.qk_norm=true (it is the epsilon of "
                             f"the q/k norm)")
        attn.q_norm = nn.Parameter(torch.ones(attn.head_dim))
        attn.k_norm = nn.Parameter(torch.ones(attn.head_dim))
        self.eps, self.dim = qk_norm_eps, (attn.head_dim,)

    def before_rotation(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.rms_norm(q, self.dim, attn.q_norm, self.eps), F.rms_norm(k, self.dim, attn.k_norm, self.eps)

    def norm_key(self, attn: nn.Module, k: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(k, self.dim, attn.k_norm, self.eps)


PARTS = {"qk_norm": QKNorm}
