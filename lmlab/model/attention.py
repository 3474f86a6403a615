"""Causal self-attention and its key/value-head sharing options.

Contract: `Attention(cfg, *, score, qk_norm, logn_scaling, temperature)`; `forward(x, pos, cache=None)` maps
(B, T, C) -> (B, T, C), where `pos` is the model's Position (its `rotate` and `attn_bias` hooks) and `cache` this
layer's `LayerCache` when generating (the keys and values of the tokens before these T). The options differ only in
how many key/value heads they keep (`kv_heads`), which `GPTConfig` resolves once. `score` picks how logits become
weights (`lmlab.model.score`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.mask import layer_window
from lmlab.model.score import SCORES, attend, explicit_weights, key_counts, log_ratio, per_query, scale_queries
from lmlab.registry import PositiveFloat, PositiveInt, build

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.cache import LayerCache
    from lmlab.model.position import Position


@dataclass(frozen=True)
class Geometry:
    """A layer's attention from its sizes and keys alone (`geometry`): what the block kind reports as its own
    (lmlab.model.block) and the size bounds, FLOPs and memory checks read."""

    heads: int  # query heads (ALiBi's slopes)
    head_dim: int  # the size the position scheme rotates per head (RoPE's)
    cache_width: int  # numbers the KV cache holds per token
    attn_width: int  # the scores' query/key width plus the width they weigh (values), over the heads
    n_params: int  # weights (gains aside)


class MHA(nn.Module):
    """Multi-head attention (Vaswani et al., 2017), one key/value head per query head.

    Fast path: one fused QKV matmul and `F.scaled_dot_product_attention(is_causal=True)`; a materialised
    mask only when the position scheme adds a bias (ALiBi). Keys:
    - score: how logits become weights (`lmlab.model.score`: softmax, softmax_plus, relu2); the scores that
      are not a softmax run explicitly, with the (T, T) matrix held;
    - qk_norm: RMS-normalise q and k per head before the dot product (Dehghani et al., 2023), bounding logits;
      qk_norm_eps its epsilon (null: torch's default, the dtype's machine epsilon; Qwen3 uses its rms_norm_eps);
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
                 gate: Literal["elementwise", "headwise"] | None = None, sinks: bool = False,
                 qk_norm_eps: PositiveFloat | None = None) -> None:
        super().__init__()
        if qk_norm_eps is not None and not qk_norm:
            raise ValueError(f"attention.qk_norm_eps={qk_norm_eps} needs attention.qk_norm=true (it is the epsilon of "
                             f"the q/k norm)")
        if sinks and score != "softmax":
            raise ValueError(f"attention.sinks=true needs attention.score=softmax (got {score!r}): a sink is a column "
                             f"of the softmax")
        if doc_mask and cfg.eod_id is None:
            raise ValueError("attention.doc_mask=true needs an end-of-document token to find the documents by: set "
                             "data.eod (e.g. data.eod='<|endoftext|>'), which ends each packed document")
        self.doc_mask = doc_mask
        self.layer = layer
        self.value_mixes = nn.ModuleList()  # v -> v mixed with other values (residual=value_residual, value_embed)
        self.window = layer_window(window, pattern, layer, cfg.n_layer, cfg.max_seq_len)  # None: the whole context
        self.softcap = softcap
        self.score = build("attention.score", SCORES, {"name": score}, cfg.train_len)
        if logn_scaling and self.score.query_scale(torch.ones(1)) is not None:
            raise ValueError(f"attention.logn_scaling=true with attention.score={score!r}, which already scales "
                             f"the logits by log_L(n); use one of the two")
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.train_len, self.logn_scaling = cfg.train_len, logn_scaling
        self.dropout = cfg.dropout
        qk_dim, self.v_dim = self.project(cfg)
        self.scale = 1.0 / (math.sqrt(qk_dim) * temperature)
        self.gate = None if gate is None else nn.Linear(cfg.d_model, gate_width(gate, self.n_head, self.v_dim),
                                                        bias=cfg.bias)
        self.sink = nn.Parameter(torch.zeros(self.n_head)) if sinks else None  # logit 0: e^0 beside the keys' at init
        self.q_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None
        self.qk_norm_eps = qk_norm_eps

    def project(self, cfg: GPTConfig) -> tuple[int, int]:
        """Build the projections; return the size of a query/key head and of a value head."""
        self.c_attn = nn.Linear(cfg.d_model, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=cfg.bias)
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.c_attn.fused = (q_dim, kv_dim, kv_dim)  # the q, k, v rows (read by the inits and by `qkv`)
        self.c_attn.value_parts = (False, False, True)  # DeepNet's gain goes to v, not q and k (lmlab.model.init)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, cfg.d_model, bias=cfg.bias)
        self.c_proj.is_residual_proj = True  # read by the init schemes (GPT-2's 1/sqrt(2L) scaling)
        return self.head_dim, self.head_dim

    @classmethod
    def fill(cls, cfg: GPTConfig, spec: dict[str, Any]) -> dict[str, Any]:
        """The option's spec as the record keeps it, sizes the option derives filled in (MLA's); here unchanged."""
        return spec

    @classmethod
    def geometry(cls, cfg: GPTConfig, **params: Any) -> Geometry:
        """What a layer of this option is, from the sizes and its keys alone (nothing built): its heads and the size
        the position scheme rotates, the KV cache's numbers per token, the scores' widths, its weights."""
        nh, hd, kv = cfg.n_head, cfg.head_dim, cfg.kv_heads
        qkv = (nh + 2 * kv) * hd
        n = cfg.d_model * qkv + nh * hd * cfg.d_model + cfg.bias * (qkv + cfg.d_model)
        n += (cfg.d_model + cfg.bias) * gate_width(params.get("gate"), nh, hd) + nh * bool(params.get("sinks"))
        return Geometry(heads=nh, head_dim=hd, cache_width=2 * kv * hd, attn_width=2 * nh * hd, n_params=n)

    def qkv(self, x: torch.Tensor, pos: Position, offset: int = 0, doc: torch.Tensor | None = None,
            cache: LayerCache | None = None, mix: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Project and position-encode tokens at positions offset..offset+T-1; q (B, nh, T, hs), k and v (B, nkv, S,
        hs): these T tokens' keys and values, after the cached ones when a `cache` is given (S = what it holds, a
        windowed layer's last W - 1, plus T). `doc` (B, offset + T): every position's document number when the model
        has an end-of-document token (the position scheme's, under per_document; the keys counted, under doc_mask),
        else None. `mix=False`: the values without the residual options' mixes (which read the model's forward: the
        monitor's `probs` runs outside it and reads no values)."""
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).split(self.c_attn.fused, dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        if self.q_norm is not None:
            q = F.rms_norm(q, (self.head_dim,), self.q_norm, self.qk_norm_eps)
            k = F.rms_norm(k, (self.head_dim,), self.k_norm, self.qk_norm_eps)
        q, k = pos.rotate(q, k, offset, doc, self.layer)
        for value_mix in self.value_mixes if mix else ():  # before caching (residual=value_residual, value_embed)
            v = value_mix(v)
        if cache is not None:
            k, v = cache.append(k, v)
        return self.scale_queries(q, offset, doc), k, v

    def scale_queries(self, q: torch.Tensor, offset: int, doc: torch.Tensor | None) -> torch.Tensor:
        """q times log-n scaling past the trained length and the score's per-query factor, where they apply."""
        T = q.size(-2)
        if self.logn_scaling and offset + T > self.train_len:
            n = key_counts(T, offset, q.device, self.window, doc if self.doc_mask else None)
            q = q * per_query(log_ratio(n, self.train_len).clamp_min(1.0).to(q.dtype))
        return scale_queries(q, self.score, offset, self.window, doc if self.doc_mask else None)

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        offset = 0 if cache is None else cache.offset
        q, k, v = self.qkv(x, pos, offset, doc, cache)  # k, v: every token so far (a windowed layer: last W - 1 + T)
        docs = None if not self.doc_mask else (doc[:, offset:], doc[:, doc.size(1) - k.size(-2):])  # queries', keys'
        y = self.mix(q, k, v, pos, offset, docs)  # (B, nh, T, hs)
        if cache is not None and self.window is not None:
            cache.keep_last(self.window - 1)  # all the next token's window reaches
        if self.gate is not None:  # (B, T, nh·hs or nh) -> (B, nh, T, hs or 1)
            y = y * torch.sigmoid(self.gate(x)).view(B, T, self.n_head, -1).transpose(1, 2)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.v_dim))

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
        q, k, _ = self.qkv(x, pos, 0, doc, mix=False)
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
                 gate: Literal["elementwise", "headwise"] | None = None, sinks: bool = False,
                 qk_norm_eps: PositiveFloat | None = None) -> None:
        super().__init__(cfg, layer, score=score, qk_norm=qk_norm, logn_scaling=logn_scaling, temperature=temperature,
                         window=window, pattern=pattern, softcap=softcap, doc_mask=doc_mask, gate=gate, sinks=sinks,
                         qk_norm_eps=qk_norm_eps)
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
        q, k, _ = self.qkv(x, pos, 0, doc, mix=False)
        docs = (doc, doc) if self.doc_mask else None
        a1, l1 = explicit_weights(q[:, 0::2], k[:, 0::2], self.score, self.scale, pos, 0, self.window, self.softcap,
                                  docs)
        a2, l2 = explicit_weights(q[:, 1::2], k[:, 1::2], self.score, self.scale, pos, 0, self.window, self.softcap,
                                  docs)
        return a1 - self.lam() * a2, torch.maximum(l1.amax(dim=(-2, -1)), l2.amax(dim=(-2, -1)))


class MLA(MHA):
    """Multi-head latent attention (DeepSeek-AI, 2024, DeepSeek-V2; V3). Keys and values come from one latent c of
    `kv_lora_rank` numbers per token, c = RMSNorm(x W_DKV), up-projected per head, [k_nope; v] = c W_UKV; the position
    is carried by a decoupled key part of `qk_rope_head_dim` numbers shared by all heads, k_rope = RoPE(x W_KR), so
    the KV cache holds only c and k_rope: `kv_lora_rank + qk_rope_head_dim` numbers per token and layer instead of
    MHA's 2·n_head·head_dim. Queries are [q_nope; RoPE(q_rope)] per head, from x W_Q, or from a compressed
    c_q = RMSNorm(x W_DQ) of `q_lora_rank` numbers (V2/V3: q = c_q W_UQ). Each head's logits read q_nope·k_nope +
    q_rope·k_rope, scaled by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), and weigh values of `v_head_dim`. The
    latent norms are RMSNorm with a gain and eps 1e-6, as DeepSeek's; under model.bias, the down projections and the
    output have biases and the up projections none (transformers' DeepseekV3). Unset sizes follow DeepSeek-V2's
    proportions to the head size d = d_model / n_head: qk_nope_head_dim = v_head_dim = d, qk_rope_head_dim = d / 2,
    kv_lora_rank = 4·d (at most d_model), q_lora_rank none (a full query projection, as V2-Lite). The cached latents
    are up-projected at every step (no weight absorption): the cache is small, the compute MHA's. qk_norm does not
    apply (the latents are normalised)."""

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, score: str = "softmax", qk_norm: bool = False,
                 logn_scaling: bool = False, temperature: PositiveFloat = 1.0, window: int | None = None,
                 pattern: list | None = None, softcap: PositiveFloat | None = None, doc_mask: bool = False,
                 gate: Literal["elementwise", "headwise"] | None = None, sinks: bool = False,
                 kv_lora_rank: PositiveInt | None = None, q_lora_rank: PositiveInt | None = None,
                 qk_rope_head_dim: PositiveInt | None = None, qk_nope_head_dim: PositiveInt | None = None,
                 v_head_dim: PositiveInt | None = None) -> None:
        if qk_norm:
            raise ValueError("attention=mla normalises its latents (RMSNorm on c_kv and c_q): attention.qk_norm=true "
                             "does not apply; use qk_norm=false")
        # read by `project`, which the base class calls (a plain attribute may be set before nn.Module.__init__)
        self.sizes = mla_sizes(cfg, kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank,
                               qk_rope_head_dim=qk_rope_head_dim, qk_nope_head_dim=qk_nope_head_dim,
                               v_head_dim=v_head_dim)
        super().__init__(cfg, layer, score=score, logn_scaling=logn_scaling, temperature=temperature, window=window,
                         pattern=pattern, softcap=softcap, doc_mask=doc_mask, gate=gate, sinks=sinks)

    @staticmethod
    def kv_heads(n_head: int, n_kv_head: int | None) -> int:
        return n_head  # every head up-projects its own keys and values from the shared latent

    @classmethod
    def fill(cls, cfg: GPTConfig, spec: dict[str, Any]) -> dict[str, Any]:
        """The spec with its unset sizes worked out (`mla_sizes`): the record holds the numbers the model used."""
        return {**spec, **mla_sizes(cfg, **{k: spec.get(k) for k in MLA_SIZES})}

    def project(self, cfg: GPTConfig) -> tuple[int, int]:
        s, nh, d = self.sizes, self.n_head, cfg.d_model
        rank, rope, nope, v = s["kv_lora_rank"], s["qk_rope_head_dim"], s["qk_nope_head_dim"], s["v_head_dim"]
        self.rank, self.rope, self.nope, self.v = rank, rope, nope, v
        if s["q_lora_rank"] is None:
            self.q_proj, self.q_a = nn.Linear(d, nh * (nope + rope), bias=False), None
        else:
            self.q_proj = None
            self.q_a = nn.Linear(d, s["q_lora_rank"], bias=cfg.bias)  # W_DQ
            self.q_a_norm = nn.Parameter(torch.ones(s["q_lora_rank"]))
            self.q_b = nn.Linear(s["q_lora_rank"], nh * (nope + rope), bias=False)  # W_UQ and W_QR
        self.kv_a = nn.Linear(d, rank + rope, bias=cfg.bias)  # W_DKV and W_KR: the cached numbers
        self.kv_a_norm = nn.Parameter(torch.ones(rank))
        self.kv_b = nn.Linear(rank, nh * (nope + v), bias=False)  # W_UK and W_UV, per head [k_nope; v]
        self.kv_b.fused = (nope, v) * nh
        self.kv_b.value_parts = (False, True) * nh  # DeepNet's gain goes to the values
        self.c_proj = nn.Linear(nh * v, d, bias=cfg.bias)
        self.c_proj.is_residual_proj = True
        return nope + rope, v

    @classmethod
    def geometry(cls, cfg: GPTConfig, **params: Any) -> Geometry:
        s = mla_sizes(cfg, **{k: params.get(k) for k in MLA_SIZES})
        nh, d, b = cfg.n_head, cfg.d_model, cfg.bias
        rank, rope, nope, v, rq = (s[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                  "v_head_dim", "q_lora_rank"))
        q = d * nh * (nope + rope) if rq is None else d * rq + b * rq + rq * nh * (nope + rope)
        n = q + (d + b) * (rank + rope) + rank * nh * (nope + v) + nh * v * d + b * d
        n += (d + b) * gate_width(params.get("gate"), nh, v) + nh * bool(params.get("sinks"))
        return Geometry(heads=nh, head_dim=rope, cache_width=rank + rope, attn_width=nh * (nope + rope + v),
                        n_params=n)

    def latents(self, x: torch.Tensor, pos: Position, offset: int, doc: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, nh, T, nope + rope) with its rope part rotated; the cached numbers: c (B, 1, T, kv_lora_rank),
        normalised, and the shared rotated key part k_rope (B, 1, T, rope)."""
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_a is None else self.q_b(F.rms_norm(self.q_a(x), (self.q_a.out_features,),
                                                                         self.q_a_norm, eps=1e-6))
        q_nope, q_rope = q.view(B, T, self.n_head, self.nope + self.rope).transpose(1, 2).split(
            (self.nope, self.rope), dim=-1)
        c, k_rope = self.kv_a(x).split((self.rank, self.rope), dim=-1)
        c = F.rms_norm(c, (self.rank,), self.kv_a_norm, eps=1e-6)[:, None]  # one "head": shared by all
        q_rope, k_rope = pos.rotate(q_rope, k_rope[:, None], offset, doc, self.layer)
        return torch.cat((q_nope, q_rope), dim=-1), c, k_rope

    def qkv(self, x: torch.Tensor, pos: Position, offset: int = 0, doc: torch.Tensor | None = None,
            cache: LayerCache | None = None, mix: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, c, k_rope = self.latents(x, pos, offset, doc)
        if cache is not None:
            c, k_rope = cache.append(c, k_rope)  # the latents only: (B, 1, S, rank), (B, 1, S, rope)
        B, _, S, _ = c.shape
        k_nope, v = self.kv_b(c[:, 0]).view(B, S, self.n_head, self.nope + self.v).transpose(1, 2).split(
            (self.nope, self.v), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, self.n_head, S, self.rope)), dim=-1)
        return self.scale_queries(q, offset, doc), k, v


MLA_SIZES = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def mla_sizes(cfg: GPTConfig, **sizes: int | None) -> dict[str, int | None]:
    """MLA's sizes with the unset ones at DeepSeek-V2's proportions to the head size d (`MLA`), checked: a rank is
    a compression, at most d_model (the rule stated in the error), and the RoPE part has an even size."""
    d = cfg.head_dim
    out = {"kv_lora_rank": sizes.get("kv_lora_rank") or min(4 * d, cfg.d_model),
           "q_lora_rank": sizes.get("q_lora_rank"),
           "qk_rope_head_dim": sizes.get("qk_rope_head_dim") or max(2, 2 * (d // 4)),
           "qk_nope_head_dim": sizes.get("qk_nope_head_dim") or d, "v_head_dim": sizes.get("v_head_dim") or d}
    for key in ("kv_lora_rank", "q_lora_rank"):
        if out[key] is not None and out[key] > cfg.d_model:
            raise ValueError(f"attention.{key}={out[key]} is larger than model.d_model={cfg.d_model}: MLA's latent "
                             f"compresses the d_model numbers of a token; choose {key} <= {cfg.d_model}")
    if out["qk_rope_head_dim"] % 2:
        raise ValueError(f"attention.qk_rope_head_dim={out['qk_rope_head_dim']} must be even: RoPE rotates pairs")
    return out


ATTENTIONS = {"mha": MHA, "gqa": GQA, "mqa": MQA, "diff": DiffAttention, "mla": MLA}
