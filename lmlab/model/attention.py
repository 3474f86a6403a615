"""Causal self-attention and its key/value-head sharing options.

Contract: `Attention(cfg, *, score, qk_norm, logn_scaling, temperature)`; `forward(x, pos, cache=None)` maps
(B, T, C) -> (B, T, C), where `pos` is the model's Position (its `rotate` and `attn_bias` hooks) and `cache` this
layer's `LayerCache` when generating (the keys and values of the tokens before these T). The options differ only in
how many key/value heads they keep (`kv_heads`), which `GPTConfig` resolves once. `score` picks how logits become
weights (`lmlab.model.score`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.mask import layer_window
from lmlab.model.score import SCORES, attend, explicit_weights, key_counts, log_ratio, per_query, scale_queries
from lmlab.registry import PositiveFloat, build

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.cache import LayerCache
    from lmlab.model.position import Position


class MHA(nn.Module):
    """Multi-head attention (Vaswani et al., 2017), one key/value head per query head.

    Fast path: one fused QKV matmul and `F.scaled_dot_product_attention(is_causal=True)`; a materialised
    mask only when the position scheme adds a bias (ALiBi). Keys:
    - score: how logits become weights (`lmlab.model.score`: softmax, softmax_plus, relu2); the scores that
      are not a softmax run explicitly, with the (T, T) matrix held;
    - qk_norm: RMS-normalise q and k per head before the dot product (Dehghani et al., 2023), bounding logits;
    - logn_scaling: multiply q at position n > L (L = the trained length) by log_L(n), keeping the attention
      entropy roughly constant as the context grows (Chiang & Cholak, 2022; Su, 2021). Zero-shot: at n <= L the
      model is unchanged; score=softmax_plus trains with the factor at every length instead (not both at once);
    - temperature: logits / temperature (on top of 1/sqrt(head_dim));
    - window: each query reads only its last W keys, itself included (sliding-window attention: Child et al., 2019;
      Beltagy et al., 2020; Mistral), in O(T·W) (lmlab.model.mask); the KV cache keeps the last W - 1 keys;
    - pattern: the layers' windows, cycled over the layers (Gemma 2/3, gpt-oss, OLMo-core's local/global layers):
      each entry `local` (the window), `global` (the whole context) or a layer's own window, e.g.
      [local,local,local,global]; its length divides n_layer;
    - softcap: c · tanh(logits / c) on the attention logits (Gemma 2), bounding them to (-c, c); explicit;
    - doc_mask: each query reads only the keys of its own document in a packed block (the model numbers documents by
      the end-of-document token, `model.eod_id`, set from data.eod); the scores count the keys of the document;
    - gate: a sigmoid gate on the attention output before the output projection, from the sublayer's input
      (Qiu et al., 2025, "Gated Attention", Qwen3-Next): `elementwise` (one gate per head dimension) or `headwise`
      (one per head); y ← y ⊙ σ(x W_g);
    - sinks: a learned sink logit per head (gpt-oss; Xiao et al., 2024's attention sinks, learned): the softmax
      normalises over the keys and the sink, whose weight reads no value; softmax scores only, explicit.
    """

    sublayer = "attn"  # the monitor's name for it (grad/norm/layer_XX/attn)
    mixes_tokens = True  # called as (x, pos, cache) by the block

    @staticmethod
    def kv_heads(n_head: int, n_kv_head: int | None) -> int:
        return n_head

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, score: str = "softmax", qk_norm: bool = False,
                 logn_scaling: bool = False, temperature: PositiveFloat = 1.0, window: int | None = None,
                 pattern: list | None = None, softcap: PositiveFloat | None = None, doc_mask: bool = False,
                 gate: Literal["elementwise", "headwise"] | None = None, sinks: bool = False) -> None:
        super().__init__()
        if sinks and score != "softmax":
            raise ValueError(f"attention.sinks=true needs attention.score=softmax (got {score!r}): a sink is a column "
                             f"of the softmax")
        if doc_mask and cfg.eod_id is None:
            raise ValueError("attention.doc_mask=true needs an end-of-document token to find the documents by: set "
                             "data.eod (e.g. data.eod='<|endoftext|>'), which ends each packed document")
        self.doc_mask = doc_mask
        self.layer = layer
        self.window = layer_window(window, pattern, layer, cfg.n_layer, cfg.max_seq_len)  # None: the whole context
        self.softcap = softcap
        self.score = build("attention.score", SCORES, {"name": score}, cfg.train_len)
        if logn_scaling and self.score.query_scale(torch.ones(1)) is not None:
            raise ValueError(f"attention.logn_scaling=true with attention.score={score!r}, which already scales "
                             f"the logits by log_L(n); use one of the two")
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.train_len, self.logn_scaling = cfg.train_len, logn_scaling
        self.scale = 1.0 / (math.sqrt(self.head_dim) * temperature)
        self.dropout = cfg.dropout
        self.c_attn = nn.Linear(cfg.d_model, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=cfg.bias)
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.c_attn.fused = (q_dim, kv_dim, kv_dim)  # the q, k, v rows (read by the inits and by `qkv`)
        self.c_attn.value_parts = (False, False, True)  # DeepNet's gain goes to v, not q and k (lmlab.model.init)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, cfg.d_model, bias=cfg.bias)
        self.c_proj.is_residual_proj = True  # read by the init schemes (GPT-2's 1/sqrt(2L) scaling)
        self.gate = None if gate is None else nn.Linear(cfg.d_model, gate_width(gate, self.n_head, self.head_dim),
                                                        bias=cfg.bias)
        self.sink = nn.Parameter(torch.zeros(self.n_head)) if sinks else None  # logit 0: e^0 beside the keys' at init
        self.q_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None

    def qkv(self, x: torch.Tensor, pos: Position, offset: int = 0, doc: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project and position-encode tokens at positions offset..offset+T-1; q (B, nh, T, hs), k and v (B, nkv, T,
        hs). `doc` (B, offset + T): every position's document number when the model has an end-of-document token (the
        position scheme's, under per_document; the keys counted, under doc_mask), else None."""
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(self.c_attn.fused, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_norm is not None:
            q = F.rms_norm(q, (self.head_dim,), self.q_norm)
            k = F.rms_norm(k, (self.head_dim,), self.k_norm)
        q, k = pos.rotate(q, k, offset, doc, self.layer)
        if self.logn_scaling and offset + T > self.train_len:
            n = key_counts(T, offset, x.device, self.window, doc if self.doc_mask else None)
            q = q * per_query(log_ratio(n, self.train_len).clamp_min(1.0).to(q.dtype))
        return scale_queries(q, self.score, offset, self.window, doc if self.doc_mask else None), k, v

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        offset = 0 if cache is None else cache.offset
        q, k, v = self.qkv(x, pos, offset, doc)
        if cache is not None:
            k, v = cache.append(k, v)  # (B, nkv, S, hs): every token so far (a windowed layer: its last W - 1 + T)
        docs = None if not self.doc_mask else (doc[:, offset:], doc[:, doc.size(1) - k.size(-2):])  # queries', keys'
        y = self.mix(q, k, v, pos, offset, docs)  # (B, nh, T, hs)
        if cache is not None and self.window is not None:
            cache.keep_last(self.window - 1)  # all the next token's window reaches
        if self.gate is not None:  # (B, T, nh·hs or nh) -> (B, nh, T, hs or 1)
            y = y * torch.sigmoid(self.gate(x)).view(B, T, self.n_head, -1).transpose(1, 2)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim))

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: Position, offset: int,
            docs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """The values weighed: q (B, nh, T, hs), k and v (B, nkv, S, hs) -> (B, nh, T, hs)."""
        return attend(q, k, v, self.score, self.scale, pos, offset, self.dropout if self.training else 0.0,
                      self.window, self.softcap, docs, self.sink)

    @property
    def sums_to_one(self) -> bool:
        """Whether each row of the weights (`probs`), with a sink's share beside it, is a distribution: the score's."""
        return self.score.sums_to_one

    def probs(self, x: torch.Tensor, pos: Position, doc: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention weights (B, nh, T, T) (rows sum to one when `score.sums_to_one`) and the max logit per
        head (B, nh), computed explicitly (for monitoring)."""
        q, k, _ = self.qkv(x, pos, 0, doc)
        k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)  # (B, nh, T, hs)
        weights, logits = explicit_weights(q, k, self.score, self.scale, pos, 0, self.window, self.softcap,
                                           (doc, doc) if self.doc_mask else None, self.sink)
        return weights, logits.amax(dim=(-2, -1))


def gate_width(gate: str | None, n_head: int, head_dim: int) -> int:
    """The outputs of an attention gate's projection: one per head dimension (elementwise), one per head, or 0."""
    return {None: 0, "elementwise": n_head * head_dim, "headwise": n_head}[gate]


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


class DiffAttention(MHA):
    """Differential attention (Ye et al., 2024, "Differential Transformer"): the difference of two softmax maps
    cancels the attention noise they share, A = softmax(Q₁K₁ᵀ/√d) − λ·softmax(Q₂K₂ᵀ/√d), out = A·V, then each
    differential head is RMS-normalised and scaled by (1 − λ_init). The query/key heads pair up, (2j, 2j + 1) being
    (Q₁, Q₂) and (K₁, K₂) of differential head j, which weighs the values of both, V = [v_2j; v_2j+1] (width 2d): the
    paper's h = d_model / 2d heads, with lmlab's parameter count (the same fused QKV and output projection) and its
    head geometry (RoPE rotates each head of size d). λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, the four vectors
    of size d learned per layer (init N(0, 0.1)), λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) at layer l = 1 .. L. Softmax
    scores only; windows, documents and softcaps apply to both maps."""

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, score: str = "softmax", qk_norm: bool = False,
                 logn_scaling: bool = False, temperature: PositiveFloat = 1.0, window: int | None = None,
                 pattern: list | None = None, softcap: PositiveFloat | None = None, doc_mask: bool = False,
                 gate: Literal["elementwise", "headwise"] | None = None, sinks: bool = False) -> None:
        super().__init__(cfg, layer, score=score, qk_norm=qk_norm, logn_scaling=logn_scaling, temperature=temperature,
                         window=window, pattern=pattern, softcap=softcap, doc_mask=doc_mask, gate=gate, sinks=sinks)
        if self.n_head % 2:
            raise ValueError(f"attention=diff pairs its heads into differential heads: model.n_head={self.n_head} "
                             f"must be even")
        if score != "softmax" or sinks or gate:
            raise ValueError("attention=diff is a difference of two softmax maps: it takes attention.score=softmax, "
                             "without sinks or a gate")
        if cfg.position.get("name") == "alibi":
            raise ValueError("attention=diff with position=alibi: ALiBi's slopes are per head, a differential head "
                             "has two maps; use position=rope")
        d = self.head_dim
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer)  # l - 1 = layer (0-based)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(d) * 0.1) for _ in range(4))
        self.subln = nn.Parameter(torch.ones(2 * d))  # the per-head RMSNorm's gain, over a differential head's 2d

    def lam(self) -> torch.Tensor:
        return (torch.exp((self.lambda_q1 * self.lambda_k1).sum()) - torch.exp((self.lambda_q2 * self.lambda_k2).sum())
                + self.lambda_init)

    @staticmethod
    def _pairs(v: torch.Tensor) -> torch.Tensor:
        """(B, h, S, d) -> (B, h/2, S, 2d): the values of heads 2j and 2j + 1 side by side."""
        return torch.cat((v[:, 0::2], v[:, 1::2]), dim=-1)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: Position, offset: int,
            docs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        values = self._pairs(v)
        y1 = attend(q[:, 0::2], k[:, 0::2], values, self.score, self.scale, pos, offset, p, self.window, self.softcap,
                    docs)
        y2 = attend(q[:, 1::2], k[:, 1::2], values, self.score, self.scale, pos, offset, p, self.window, self.softcap,
                    docs)
        y = F.rms_norm(y1 - self.lam().to(y1.dtype) * y2, (2 * self.head_dim,), self.subln, eps=1e-5)
        y = y * (1 - self.lambda_init)  # (B, h/2, T, 2d)
        B, h2, T, _ = y.shape  # back to (B, nh, T, d): differential head j's halves as heads 2j, 2j + 1
        return y.view(B, h2, T, 2, self.head_dim).transpose(2, 3).reshape(B, 2 * h2, T, self.head_dim)

    @property
    def sums_to_one(self) -> bool:
        return False  # A₁ − λA₂: its rows sum to 1 − λ and it has negative entries

    def probs(self, x: torch.Tensor, pos: Position, doc: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The differential maps A = A₁ − λA₂ (B, nh/2, T, T) and the max logit of either map (B, nh/2)."""
        q, k, _ = self.qkv(x, pos, 0, doc)
        docs = (doc, doc) if self.doc_mask else None
        a1, l1 = explicit_weights(q[:, 0::2], k[:, 0::2], self.score, self.scale, pos, 0, self.window, self.softcap,
                                  docs)
        a2, l2 = explicit_weights(q[:, 1::2], k[:, 1::2], self.score, self.scale, pos, 0, self.window, self.softcap,
                                  docs)
        return a1 - self.lam() * a2, torch.maximum(l1.amax(dim=(-2, -1)), l2.amax(dim=(-2, -1)))


ATTENTIONS = {"mha": MHA, "gqa": GQA, "mqa": MQA, "diff": DiffAttention}
