"""ALiBi: a fixed linear bias on the attention logits."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lmlab.model.position.base import Position


def alibi_slopes(n_head: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al., 2022): 2^(-8i/n) for i = 1..n when n is a power of two; otherwise the
    slopes of the nearest lower power of two m, then every other slope of 2m, as in the paper's code."""
    m = 2 ** math.floor(math.log2(n_head))
    base = [2 ** (-8 * i / m) for i in range(1, m + 1)]
    extra = [2 ** (-8 * i / (2 * m)) for i in range(1, 2 * m + 1)][0::2][: n_head - m]
    return torch.tensor(base + extra)


class ALiBi(Position):
    """Attention with linear biases (Press et al., 2022): logit(i, j) += -slope_h · (i − j). No embeddings.
    Bidirectional (`causal` False, head=mlm): -slope_h · |i − j|, the symmetric form encoders use (the paper defines
    the causal one only)."""

    logit_bias = "position=alibi adds −m·distance to every logit"

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any]) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.register_buffer("slopes", alibi_slopes(n_head), persistent=False)

    @classmethod
    def attention_bytes(cls, n_head: int, T: int, batch: int) -> int:
        # attn_bias: float32 (T, T) distances and a bool (T, T) mask, then the (nh, T, T) bias and its masked copy.
        # With an explicit mask SDPA runs its math path: (B, nh, T, T) float32 scores and their softmax (measured on
        # CPU at T=4096, nh=4: 613 MB peak for attn_bias, estimate 592 MB; SDPA 579 MB more, estimate 536 MB).
        return T * T * (5 + 8 * n_head) + 8 * batch * n_head * T * T

    def attn_bias(self, T: int, device: torch.device, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        i = torch.arange(offset, offset + T, device=device)  # the queries' positions
        j = torch.arange(offset + T, device=device)  # the keys': every token so far
        dist = (j[None, :] - i[:, None]).to(torch.float32)  # (T, offset + T): j - i, <= 0 in the causal part
        if not self.causal:  # both ways: the distance's size
            return (self.slopes.to(device)[:, None, None] * -dist.abs()).to(dtype)
        bias = self.slopes.to(device)[:, None, None] * dist  # (nh, T, offset + T)
        return bias.masked_fill(dist > 0, float("-inf")).to(dtype)


OPTIONS = {"alibi": ALiBi}
