"""The Gated Attention Unit (FLASH, Hua et al., 2022; GAU-α, Su, 2022): one sublayer doing the work of an attention
+ FFN pair.

    U = φ(X W_u), V = φ(X W_v)                  (T, e) each, e = expansion · d
    Z = φ(X W_z)                                (T, s), a shared low-dimensional key size s
    Q = Z ⊙ γ_q + β_q, K = Z ⊙ γ_k + β_k        per-dimension scale and offset, then RoPE (the position hooks)
    A = score(Q Kᵀ / √s + bias)                 one head; relu²/n (FLASH), softmax_plus (GAU-α) or softmax
    O = (U ⊙ A V) W_o

φ is the `activation` group (SiLU/Swish in the paper; biases when model.bias). W_u, W_v, W_z are one fused matrix
`c_fc` (rows u, v, z). β starts at 0; γ at 1 (`qk_init=ones`, lmlab's default: Q = K = Z at init) or, as FLASH's
code does, drawn from N(0, 0.02) (`qk_init=flash`: Q and K start ~50× smaller than Z, so relu² scores start ~1e-7 of
lmlab's); the init schemes keep them, like norm weights. Parameters:
d·(2e + s) + e·d + 4s (+ 2e + s + d biases).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.model.activation import Activation
from lmlab.model.attention.score import SCORES, attend, explicit_weights, scale_queries
from lmlab.registry import build

if TYPE_CHECKING:
    from lmlab.model.attention.cache import LayerCache
    from lmlab.model.position import Position


class GAU(nn.Module):
    sublayer = "gau"  # the monitor's name for it (grad/norm/layer_XX/gau)
    mixes_tokens = True  # called as (x, pos, cache) by the block
    sink_share = False  # no sink column: its weights are all the tokens' (lmlab.model.capabilities.AttentionWeights)
    reads_positions = True  # the position scheme reaches it (its rotation, its logit bias)

    def __init__(self, dim: int, s: int, e: int, *, score: str, activation: Mapping[str, Any], bias: bool,
                 train_len: int, dropout: float = 0.0, qk_init: str = "ones") -> None:
        super().__init__()
        self.s, self.e, self.dropout = s, e, dropout
        self.score = build("block.score", SCORES, {"name": score}, train_len)
        self.scale = 1.0 / math.sqrt(s)
        self.c_fc = nn.Linear(dim, 2 * e + s, bias=bias)
        self.c_fc.fused = (e, e, s)  # the u, v, z rows
        self.c_fc.value_parts = (True, True, False)  # DeepNet's gain goes to u and v, not to z (queries and keys)
        self.act = Activation(activation)
        self.q_gamma, self.k_gamma = nn.Parameter(torch.ones(s)), nn.Parameter(torch.ones(s))
        self.q_beta, self.k_beta = nn.Parameter(torch.zeros(s)), nn.Parameter(torch.zeros(s))
        if qk_init == "flash":  # FLASH's ScaleOffset: γ ~ N(0, 0.02), β = 0 (Hua et al., 2022, Appendix code)
            with torch.no_grad():
                nn.init.normal_(self.q_gamma, std=0.02)
                nn.init.normal_(self.k_gamma, std=0.02)
        self.c_proj = nn.Linear(e, dim, bias=bias)
        self.c_proj.is_residual_proj = True

    def qkv(self, x: torch.Tensor, pos: Position, offset: int = 0, doc: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """u (B, T, e); q, k (B, 1, T, s) rotated, q with the score's query factor; v (B, 1, T, e)."""
        u, v, z = self.act(self.c_fc(x)).split(self.c_fc.fused, dim=-1)
        z = z.unsqueeze(1)  # (B, 1, T, s): one head
        q, k = pos.rotate(z * self.q_gamma + self.q_beta, z * self.k_gamma + self.k_beta, offset, doc)
        return u, scale_queries(q, self.score, offset, causal=pos.causal), k, v.unsqueeze(1)

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:  # doc: for the position scheme (per_document)
        offset = 0 if cache is None else cache.offset
        u, q, k, v = self.qkv(x, pos, offset, doc)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, 1, offset + T, s) and (B, 1, offset + T, e)
        av = attend(q, k, v, self.score, self.scale, pos, offset, self.dropout if self.training else 0.0)
        return self.c_proj(u * av.squeeze(1))  # (B, T, d)

    def probs(self, x: torch.Tensor, pos: Position, doc: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention weights (B, 1, T, T) and the max logit (B, 1), computed explicitly (for monitoring)."""
        _, q, k, _ = self.qkv(x, pos, 0, doc)
        weights, logits = explicit_weights(q, k, self.score, self.scale, pos)
        return weights, logits.amax(dim=(-2, -1))
