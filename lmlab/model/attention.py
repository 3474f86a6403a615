"""Causal self-attention and its key/value-head sharing options.

Contract: `Attention(cfg, *, qk_norm, logn_scaling, temperature)`; `forward(x, pos, cache=None)` maps (B, T, C) ->
(B, T, C), where `pos` is the model's Position (its `rotate` and `attn_bias` hooks) and `cache` this layer's
`LayerCache` when generating (the keys and values of the tokens before these T). The options differ only in how
many key/value heads they keep (`kv_heads`), which `GPTConfig` resolves once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.registry import PositiveFloat

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.cache import LayerCache
    from lmlab.model.position import Position


class MHA(nn.Module):
    """Multi-head attention (Vaswani et al., 2017), one key/value head per query head.

    Fast path: one fused QKV matmul and `F.scaled_dot_product_attention(is_causal=True)`; a materialised
    mask only when the position scheme adds a bias (ALiBi). Flags:
    - qk_norm: RMS-normalise q and k per head before the dot product (Dehghani et al., 2023), bounding logits;
    - logn_scaling: multiply q at position n > L (L = the trained length) by log_L(n), keeping the attention
      entropy roughly constant as the context grows (Chiang & Cholak, 2022; Su, 2021);
    - temperature: logits / temperature (on top of 1/sqrt(head_dim)).
    """

    @staticmethod
    def kv_heads(n_head: int, n_kv_head: int | None) -> int:
        return n_head

    def __init__(self, cfg: GPTConfig, *, qk_norm: bool = False, logn_scaling: bool = False,
                 temperature: PositiveFloat = 1.0) -> None:
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.train_len, self.logn_scaling = cfg.train_len, logn_scaling
        self.scale = 1.0 / (math.sqrt(self.head_dim) * temperature)
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=cfg.bias)
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.c_attn.fused = (q_dim, kv_dim, kv_dim)  # the q, k, v rows (read by the inits and by `qkv`)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, cfg.d_model, bias=cfg.bias)
        self.c_proj.is_residual_proj = True  # read by the init schemes (GPT-2's 1/sqrt(2L) scaling)
        self.q_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None

    def qkv(self, x: torch.Tensor, pos: Position, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project and position-encode tokens at positions offset..offset+T-1; q (B, nh, T, hs), k and v (B, nkv, T,
        hs)."""
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(self.c_attn.fused, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_norm is not None:
            q = F.rms_norm(q, (self.head_dim,), self.q_norm)
            k = F.rms_norm(k, (self.head_dim,), self.k_norm)
        q, k = pos.rotate(q, k, offset)
        if self.logn_scaling and offset + T > self.train_len:
            n = torch.arange(offset + 1, offset + T + 1, device=x.device, dtype=torch.float32)
            q = q * (n.log() / math.log(self.train_len)).clamp_min(1.0).to(q.dtype)[:, None]  # (T, 1)
        return q, k, v

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None) -> torch.Tensor:
        B, T, C = x.shape
        offset = 0 if cache is None else cache.offset
        q, k, v = self.qkv(x, pos, offset)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, nkv, offset + T, hs): every token so far
        bias = pos.attn_bias(T, x.device, q.dtype, offset)  # (nh, T, offset + T), -inf where j > i, or None
        if bias is None and offset and T > 1:  # SDPA's is_causal aligns to the top left: say where each query is
            bias = torch.ones(T, offset + T, dtype=torch.bool, device=x.device).tril(offset)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=bias, is_causal=bias is None and not offset,
            dropout_p=self.dropout if self.training else 0.0, scale=self.scale,
            enable_gqa=self.n_kv_head != self.n_head)  # (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))

    def probs(self, x: torch.Tensor, pos: Position) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention probabilities and the max logit per head, computed explicitly (for monitoring)."""
        T = x.size(1)
        q, k, _ = self.qkv(x, pos)
        k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)  # (B, nh, T, hs)
        logits = (q @ k.transpose(-2, -1)) * self.scale  # (B, nh, T, T)
        bias = pos.attn_bias(T, x.device, logits.dtype)
        if bias is None:
            bias = torch.full((T, T), float("-inf"), device=x.device, dtype=logits.dtype).triu(1)
        logits = logits + bias
        return logits.softmax(dim=-1), logits.amax(dim=(-2, -1))


class GQA(MHA):
    """Grouped-query attention (Ainslie et al., 2023): n_head query heads share model.n_kv_head key/value heads."""

    @staticmethod
    def kv_heads(n_head: int, n_kv_head: int | None) -> int:
        if n_kv_head is None:
            raise ValueError(f"attention=gqa needs model.n_kv_head (a divisor of model.n_head={n_head})")
        return n_kv_head


class MQA(MHA):
    """Multi-query attention (Shazeer, 2019): every query head shares one key/value head."""

    @staticmethod
    def kv_heads(n_head: int, n_kv_head: int | None) -> int:
        return 1


ATTENTIONS = {"mha": MHA, "gqa": GQA, "mqa": MQA}
