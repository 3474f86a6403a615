"""Multi-head attention and its key/value-head sharing options (MHA, GQA, MQA: a head count), the contract every
attention option keeps (`lmlab.model.attention`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.model.attention.parts import HOOKS, PARTS, Parts, Widths, check, part_keys, parts_geometry
from lmlab.model.attention.score import (
    SCORES,
    attend,
    explicit_weights,
    key_counts,
    log_ratio,
    memory_first,
    per_query,
    scale_queries,
)
from lmlab.model.steps import FollowsStep
from lmlab.registry import PositiveFloat, build, option_defaults

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import LayerCache
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


def refuse(cls: type, given: dict[str, Any]) -> None:
    """A variant's `refuses` (keys it inherits from MHA without a form for them): each must be at MHA's default."""
    defaults = option_defaults(MHA)
    for key, why in cls.refuses.items():
        if given[key] != defaults[key]:
            raise ValueError(f"{why}: attention.{key}={yaml_value(given[key])} does not apply; leave it at "
                             f"{yaml_value(defaults[key])}")


def yaml_value(value: Any) -> str:
    """A value as a command line writes it: true, null, 'relu2', 4."""
    return "true" if value is True else "false" if value is False else "null" if value is None else repr(value)


class MHA(FollowsStep, nn.Module):
    """Multi-head attention (Vaswani et al., 2017), one key/value head per query head.

    Fast path: one fused QKV matmul and `F.scaled_dot_product_attention(is_causal=True)`; a materialised
    mask only when the position scheme adds a bias (ALiBi). Its own keys:
    - score: how logits become weights (`lmlab.model.attention.score`: softmax, softmax_plus, relu2); the scores that
      are not a softmax run explicitly, with the (T, T) matrix held;
    - logn_scaling: multiply q at position n > L (L = the trained length) by log_L(n), keeping the attention
      entropy roughly constant as the context grows (Chiang & Cholak, 2022; Su, 2021). Zero-shot: at n <= L the
      model is unchanged; score=softmax_plus trains with the factor at every length instead (not both at once);
    - temperature: logits / temperature (on top of 1/sqrt(head_dim));
    - softcap: c · tanh(logits / c) on the attention logits (Gemma 2), bounding them to (-c, c); explicit;
    - doc_mask: each query reads only the keys of its own document in a packed block (the model numbers documents by
      the end-of-document token, `model.eod_id`, set from data.eod); the scores count the keys of the document.
    And the keys of its parts, the attention-wide features every option takes, each in its file of
    `lmlab.model.attention.parts` with its hooks (`PARTS`): qk_norm and qk_norm_eps, the windows (window, pattern,
    window_block, window_schedule, eval_window), gate and gate_channels, sinks, forget_gate and forget_bias, mem_kv,
    xsa, key_offset, paired_heads.
    """

    sublayer = "attn"  # the monitor's name for it (grad/norm/layer_XX/attn)
    mixes_tokens = True  # called as (x, pos, cache) by the block
    reads_positions = True  # the position scheme reaches it (its rotation, its logit bias)
    # Its weights are one map of the scaled dot products q·k/√d of the fused q, k, v projection (what
    # tests/unit/model/attention/test_attention.py checks by formula); an option with its own formula says False and is
    # checked by it.
    scaled_dot_product = True
    PARTS = PARTS  # the attention-wide features: their keys are this option's too (lmlab.registry reads them here)
    # the parts' hooks this option calls (a part on that fills another is refused by key): a variant that computes a
    # step its own way (its projections, its weights) leaves that step's hooks out
    runs_hooks: frozenset[str] = frozenset(HOOKS)
    # MHA's keys a variant (which inherits them all through `**shared`: lmlab.registry) has no form for, each with
    # why: any value but the default is refused in one place, before anything is built (`refuse`)
    refuses: dict[str, str] = {}

    @staticmethod
    def kv_heads(n_head: int, n_kv_head: int | None) -> int:
        return n_head

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, score: str = "softmax", logn_scaling: bool = False,
                 temperature: PositiveFloat = 1.0, softcap: PositiveFloat | None = None, doc_mask: bool = False,
                 **parts: Any) -> None:
        if unknown := sorted(parts.keys() - part_keys().keys()):
            raise TypeError(f"{type(self).__name__} takes no keys {unknown}")
        given = {**option_defaults(MHA), **parts, "score": score, "logn_scaling": logn_scaling,
                 "temperature": temperature, "softcap": softcap, "doc_mask": doc_mask}
        refuse(type(self), given)
        check(given)  # the parts' requires and excludes
        super().__init__()
        if doc_mask and cfg.eod_id is None:
            raise ValueError("attention.doc_mask=true needs an end-of-document token to find the documents by: set "
                             "data.eod (e.g. data.eod='<|endoftext|>'), which ends each packed document "
                             "(data=token_bin: data.doc_sep, the separator's id)")
        self.layer, self.doc_mask, self.softcap, self.dropout = layer, doc_mask, softcap, cfg.dropout
        self.value_mixes = nn.ModuleList()  # v -> v mixed with other values (residual=value_residual, value_embed)
        self.score = build("attention.score", SCORES, {"name": score}, cfg.train_len)
        if logn_scaling and self.score.query_scale(torch.ones(1)) is not None:
            raise ValueError(f"attention.logn_scaling=true with attention.score={score!r}, which already scales "
                             f"the logits by log_L(n); use one of the two")
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.train_len, self.logn_scaling = cfg.train_len, logn_scaling
        self.qk_dim, self.v_dim = self.project(cfg)
        self.scale = 1.0 / (math.sqrt(self.qk_dim) * temperature)
        self.qk_map: nn.Module | None = None  # a map (q, k) -> (q, k) after the rotation (norm=ngpt's sphere and s_qk)
        self.parts = Parts(self, cfg, given)  # the attention-wide features on: their weights, their hooks

    def _follow_step(self) -> None:
        window = self.windows.at(*self.step_at, self.training)
        if (window, type(window)) != (self.window, type(self.window)):
            self.window = window  # only on a change (a compiled forward guards on it); BlockWindows are interned

    def project(self, cfg: GPTConfig) -> tuple[int, int]:
        """Build the projections; return the size of a query/key head and of a value head."""
        self.c_attn = nn.Linear(cfg.d_model, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=cfg.bias)
        q_dim, kv_dim = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        self.c_attn.fused = (q_dim, kv_dim, kv_dim)  # the q, k, v rows (read by the inits and by `qkv`)
        self.c_attn.value_parts = (False, False, True)  # DeepNet's gain goes to v, not q and k (lmlab.model.init)
        self.c_attn.head_rows = self.head_dim  # rows per head of q and k (Muon's optim.split=heads)
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
        parts_n, parts_cache = parts_geometry(cfg, Widths(nh, kv, hd, hd), params)
        return Geometry(heads=nh, head_dim=hd, cache_width=2 * kv * hd + parts_cache, attn_width=2 * nh * hd,
                        n_params=n + parts_n)

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
        q, k = self.parts.before_rotation(self, q, k)  # (attention.qk_norm)
        q, k = self.parts.rotate(self, pos, q, k, offset, doc)  # the position scheme's (attention.paired_heads: slots')
        k = self.parts.after_rotation(self, k, pos, offset, doc, cache if mix else None)  # (attention.key_offset)
        if self.qk_map is not None:  # before caching: the cache holds the keys as the logits read them
            q, k = self.qk_map(q, k)
        for value_mix in self.value_mixes if mix else ():  # before caching (residual=value_residual, value_embed)
            v = value_mix(v, x)  # x: the attention's input, which a gated mix reads
        if cache is not None:
            k, v = cache.append(k, v)
        return self.scale_queries(q, offset, doc, pos.causal), k, v

    def scale_queries(self, q: torch.Tensor, offset: int, doc: torch.Tensor | None, causal: bool = True
                      ) -> torch.Tensor:
        """q times log-n scaling past the trained length and the score's per-query factor, where they apply (of the
        keys each query reads: `causal=False`, every key of the text)."""
        T = q.size(-2)
        if self.logn_scaling and offset + T > self.train_len:
            n = key_counts(T, offset, q.device, self.window, doc if self.doc_mask else None, causal)
            q = q * per_query(log_ratio(n, self.train_len).clamp_min(1.0).to(q.dtype))
        return scale_queries(q, self.score, offset, self.window, doc if self.doc_mask else None, causal)

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        offset = 0 if cache is None else cache.offset
        q, k, v = self.qkv(x, pos, offset, doc, cache)  # k, v: every token so far (a windowed layer: last W - 1 + T)
        docs = None if not self.doc_mask else (doc[:, offset:], doc[:, doc.size(1) - k.size(-2):])  # queries', keys'
        extras = {**self.extras(x, cache), **self.parts.select(self, q, k, offset, docs)}  # columns, biases, masks
        y = self.parts.weighed(self, self.mix(q, k, v, pos, offset, docs, extras), v)  # (B, nh, T, hs) (attention.xsa)
        if cache is not None and self.window is not None:
            cache.keep_last(self.window - 1)  # all the next token's window reaches
        y = self.parts.output(self, y, x)  # (attention.gate)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.v_dim))

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: Position, offset: int,
            docs: tuple[torch.Tensor, torch.Tensor] | None, extras: dict[str, Any], scale: float | None = None
            ) -> torch.Tensor:
        """The values weighed: q (B, nh, T, hs), k and v (B, nkv, S, hs) -> (B, nh, T, hs); `extras`: the parts' key
        columns and logit biases (`extras`); `scale` in place of 1/√d·temperature."""
        scale = self.scale if scale is None else scale
        if (part := self.parts.replaces.get("attend")) is not None:  # (attention.paired_heads)
            return part.attend(self, q, k, v, scale, pos, offset, docs)
        return attend(q, k, v, self.score, scale, pos, offset, self.dropout if self.training else 0.0, self.window,
                      self.softcap, docs, **extras)

    def extras(self, x: torch.Tensor, cache: LayerCache | None = None) -> dict[str, Any]:
        """attend's extra arguments from the parts (`sink`, the memory keys and values `mem`, the forget gate's
        cumulative sums `forget`; lmlab.model.attention.parts), for tokens x (B, T, C)."""
        return self.parts.extras(self, x, cache)

    no_qk_clip: str | None = None  # why optim.qk_clip cannot rescale this option's logits (None: it can)

    def keys_read(self, seq_len: int) -> int:
        """The most keys a query reads at a context of `seq_len` (its window's, a selection's; lmlab.model.flops)."""
        return self.parts.keys_read(self, seq_len)

    def extra_flops(self, seq_len: int) -> int:
        """Forward FLOPs per token beyond the projections and the scores over `keys_read` keys (a selection's gate)."""
        return self.parts.flops(self, seq_len)

    @property
    def causal_only(self) -> str | None:
        """Why this layer cannot read the keys after a query (head=mlm refuses it; None: it can, every path reads the
        position scheme's `causal`): a part defined on the past says why (a window, a forget gate)."""
        return self.parts.causal_only(self)

    @torch.no_grad()
    def clip_logits(self, gamma: torch.Tensor) -> None:
        """QK-clip (Kimi K2): scale each head's logits by γ_h ≤ 1 (n_head,) through the weights, so that the next
        forward's q_h·k_h is γ_h times this one's. One key head serves the query heads of its group (GQA, MQA):
        it takes √(min γ over the group) and each query head γ_h over that, which is √γ_h on both sides when every
        head has its own key (MHA, Kimi's rule). The q and k rows of c_attn, and their biases, are scaled."""
        nh, nkv, hd = self.n_head, self.n_kv_head, self.head_dim
        grouped = gamma.to(torch.float32).view(nkv, nh // nkv)  # query head h reads key head h // (nh / nkv)
        k_scale = grouped.amin(dim=1).sqrt()  # (nkv,)
        q_scale = (grouped / k_scale[:, None]).reshape(nh)
        _, _, v_rows = self.c_attn.fused
        rows = torch.cat([q_scale.repeat_interleave(hd), k_scale.repeat_interleave(hd),
                          torch.ones(v_rows, device=gamma.device)]).to(self.c_attn.weight.device)
        self.c_attn.weight.mul_(rows[:, None].to(self.c_attn.weight.dtype))
        if self.c_attn.bias is not None:
            self.c_attn.bias.mul_(rows.to(self.c_attn.bias.dtype))
        self.parts.scale_keys(self, k_scale[:, None].expand(nkv, self.qk_dim))  # keys the parts hold (mem_kv)

    @property
    def sink_share(self) -> bool:
        """Whether a part takes a share of each row that reads no value (attention.sinks: the monitor's sink mass,
        1 − the tokens' weights)."""
        return "sinks" in self.parts

    @property
    def sums_to_one(self) -> bool:
        """Whether each row of the weights (`probs`), with a sink's share beside it, is a distribution: the score's,
        unless memory keys take a share (`probs` shows the tokens' weights only)."""
        return self.score.sums_to_one and not self.parts.takes_share

    def probs(self, x: torch.Tensor, pos: Position, doc: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention weights on the tokens (B, nh, T, T) (rows sum to one when `sums_to_one`) and the max logit
        per head (B, nh), memory keys' included, computed explicitly (for monitoring)."""
        q, k, _ = self.qkv(x, pos, 0, doc, mix=False)
        return self.token_weights(q, k, x, pos, doc)

    def token_weights(self, q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, pos: Position,
                      doc: torch.Tensor | None, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`probs` from q (B, nh, T, d) and k (B, nkv, T, d) of the whole text x: the tokens' weights, the max logits;
        the memory keys as `memory` gives them."""
        scale = self.scale if scale is None else scale
        if (part := self.parts.replaces.get("token_weights")) is not None:  # (attention.paired_heads)
            return part.token_weights(self, q, k, pos, doc, scale)
        extras = {**self.extras(x), **self.parts.select(self, q, k, 0, (doc, doc) if self.doc_mask else None)}
        mem = extras.get("mem")
        n_mem = 0 if mem is None else mem[0].size(-2)
        if mem is not None:
            k = memory_first(mem[0], k)
        k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)  # (B, nh, n_mem + T, hs)
        weights, logits = explicit_weights(q, k, self.score, scale, pos, 0, self.window, self.softcap,
                                           (doc, doc) if self.doc_mask else None, extras.get("sink"),
                                           extras.get("forget"), n_mem, select=extras.get("select"))
        return weights[..., n_mem:], logits.amax(dim=(-2, -1))


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


OPTIONS = {"mha": MHA, "gqa": GQA, "mqa": MQA}
