"""Multi-head attention and its key/value-head sharing options (MHA, GQA, MQA: a head count), the contract every
attention option keeps (`lmlab.model.attention`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.attention.key_offset import check_key_offset, shift_keys
from lmlab.model.attention.paired_heads import paired_attend, paired_layer, paired_weights, rotate_paired
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
from lmlab.model.attention.window import layer_windows
from lmlab.model.attention.xsa import XSA, ExclusiveSelfAttention
from lmlab.model.steps import FollowsStep
from lmlab.registry import NonNegativeInt, PositiveFloat, PositiveInt, build, option_defaults

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
    mask only when the position scheme adds a bias (ALiBi). Keys:
    - score: how logits become weights (`lmlab.model.attention.score`: softmax, softmax_plus, relu2); the scores that
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
    - window_block, window_schedule, eval_window: the windows counted in blocks of g tokens, grown over training as a
      function of the step, and used when not training (the GPT-2 speedrun's; lmlab.model.attention.window): the
      window in force is `window`, set by `set_step` and the mode (`train`/`eval`);
    - softcap: c · tanh(logits / c) on the attention logits (Gemma 2), bounding them to (-c, c); explicit;
    - doc_mask: each query reads only the keys of its own document in a packed block (the model numbers documents by
      the end-of-document token, `model.eod_id`, set from data.eod); the scores count the keys of the document;
    - gate: a sigmoid gate on the attention output before the output projection, from the sublayer's input
      (Qiu et al., 2025, "Gated Attention", Qwen3-Next): `elementwise` (one gate per head dimension) or `headwise`
      (one per head); y ← y ⊙ σ(x W_g); `gate_channels` k reads only x's first k channels (the speedrun's sparse
      attention gate, record 28: 12);
    - sinks: a learned sink logit per head (gpt-oss; Xiao et al., 2024's attention sinks, learned): the softmax
      normalises over the keys and the sink, whose weight reads no value; softmax scores only, explicit;
    - forget_gate: a forget gate per head (Lin et al., 2025, "Forgetting Transformer", FoX), f_t = σ(w_h·x_t + b_h)
      from the sublayer's input, and the logits get D_ij = Σ_{l=j+1..i} log f_l = c_i − c_j, c_t = Σ_{l≤t} log f_l
      (a key weighed down by the product of the gates since it); forget_bias is b_h at init (FoX: 0, so f ≈ 1/2);
      softmax scores; the KV cache keeps each key's c_j;
    - mem_kv: M learned key/value pairs per key/value head (Burtsev et al., 2020, "Memory Transformer"; x-transformers'
      `attn_num_mem_kv`; Darcet et al., 2023's registers) in front of the keys: every query reads them, with no
      position (unrotated: under RoPE a key at position 0; a zero position bias), no decay, under any window or
      document mask; parameters, not cached; q/k-normed with the keys under qk_norm; init N(0, 1) as
      x-transformers'; score=softmax, without sinks (a memory pair with a zero value is a sink);
    - paired_heads: heads h and h + n_head/2 read each other's keys in one softmax, over their interleaved slots
      (the GPT-2 speedrun's record 58; lmlab.model.attention.paired_heads): true, every layer; a list, those layers.
    """

    sublayer = "attn"  # the monitor's name for it (grad/norm/layer_XX/attn)
    mixes_tokens = True  # called as (x, pos, cache) by the block
    reads_positions = True  # the position scheme reaches it (its rotation, its logit bias)
    # Its weights are one map of the scaled dot products q·k/√d of the fused q, k, v projection (what
    # tests/unit/model/attention/test_attention.py checks by formula); an option with its own formula says False and is checked by it.
    scaled_dot_product = True
    no_paired_heads: str | None = None  # why attention.paired_heads has no form in this option (None: it has)
    # MHA's keys a variant (which inherits them all through `**shared`: lmlab.registry) has no form for, each with
    # why: any value but the default is refused in one place, before anything is built (`refuse`)
    refuses: dict[str, str] = {}

    @staticmethod
    def kv_heads(n_head: int, n_kv_head: int | None) -> int:
        return n_head

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, score: str = "softmax", qk_norm: bool = False,
                 logn_scaling: bool = False, temperature: PositiveFloat = 1.0, window: int | None = None,
                 pattern: list | None = None, softcap: PositiveFloat | None = None, doc_mask: bool = False,
                 gate: Literal["elementwise", "headwise"] | None = None, sinks: bool = False,
                 qk_norm_eps: PositiveFloat | None = None, forget_gate: bool = False, forget_bias: float = 0.0,
                 mem_kv: NonNegativeInt = 0,
                 window_schedule: list | dict | None = None, window_block: PositiveInt | None = None,
                 eval_window: int | list | None = None,
                 xsa: XSA | None = None, key_offset: bool = False,
                 paired_heads: bool | list[NonNegativeInt] = False, gate_channels: NonNegativeInt = 0) -> None:
        refuse(type(self), locals())
        super().__init__()
        if forget_bias != 0.0 and not forget_gate:
            raise ValueError(f"attention.forget_bias={forget_bias} needs attention.forget_gate=true (it is the "
                             f"forget gate's bias at init)")
        if mem_kv and score != "softmax":
            raise ValueError(f"attention.mem_kv={mem_kv} needs attention.score=softmax (got {score!r}): memory keys "
                             f"are columns of the softmax, which the keys counted by the other scores leave out")
        if mem_kv and sinks:  # the monitor's sink share (1 − the tokens' weights) would count the memory's too
            raise ValueError(f"attention.mem_kv={mem_kv} with attention.sinks=true: a memory pair is a learned sink "
                             f"already (one whose value is zero, its logit read from the query); use one of the two")
        if qk_norm_eps is not None and not qk_norm:
            raise ValueError(f"attention.qk_norm_eps={qk_norm_eps} needs attention.qk_norm=true (it is the epsilon of "
                             f"the q/k norm)")
        if sinks and score != "softmax":
            raise ValueError(f"attention.sinks=true needs attention.score=softmax (got {score!r}): a sink is a column "
                             f"of the softmax")
        if doc_mask and cfg.eod_id is None:
            raise ValueError("attention.doc_mask=true needs an end-of-document token to find the documents by: set "
                             "data.eod (e.g. data.eod='<|endoftext|>'), which ends each packed document (data=token_bin: "
                             "data.doc_sep, the separator's id)")
        self.doc_mask = doc_mask
        self.layer = layer
        self.value_mixes = nn.ModuleList()  # v -> v mixed with other values (residual=value_residual, value_embed)
        # attention.window / pattern, and what moves them (window_schedule, window_block, eval_window)
        self.windows = layer_windows(window, pattern, layer, cfg.n_layer, cfg.max_seq_len,
                                     window_schedule=window_schedule, window_block=window_block,
                                     eval_window=eval_window)
        self.window = self.windows.at(None, None, True)  # the window in force (None: the whole context)
        self.softcap = softcap
        self.score = build("attention.score", SCORES, {"name": score}, cfg.train_len)
        if forget_gate and not self.score.sdpa:
            raise ValueError(f"attention.forget_gate=true needs a softmax score (attention.score=softmax or "
                             f"softmax_plus; got {score!r}): the gates weigh keys down through exp(c_i − c_j)")
        if logn_scaling and self.score.query_scale(torch.ones(1)) is not None:
            raise ValueError(f"attention.logn_scaling=true with attention.score={score!r}, which already scales "
                             f"the logits by log_L(n); use one of the two")
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.train_len, self.logn_scaling = cfg.train_len, logn_scaling
        self.dropout = cfg.dropout
        qk_dim, self.v_dim = self.project(cfg)
        self.scale = 1.0 / (math.sqrt(qk_dim) * temperature)
        if gate_channels and (gate is None or gate_channels > cfg.d_model):
            raise ValueError(f"attention.gate_channels={gate_channels} is how many of the input's first channels the "
                             f"gate reads: it needs attention.gate (elementwise|headwise; got {gate}) and at most "
                             f"model.d_model={cfg.d_model} channels")
        self.gate_channels = gate_channels or cfg.d_model  # the speedrun's sparse gate reads the first 12 (record 28)
        self.gate = None if gate is None else nn.Linear(self.gate_channels, gate_width(gate, self.n_head, self.v_dim),
                                                        bias=cfg.bias)
        self.sink = nn.Parameter(torch.zeros(self.n_head)) if sinks else None  # logit 0: e^0 beside the keys' at init
        self.q_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(self.head_dim)) if qk_norm else None
        self.qk_norm_eps = qk_norm_eps
        self.forget = nn.Linear(cfg.d_model, self.n_head, bias=False) if forget_gate else None  # w_h (a hidden matrix)
        if forget_gate:  # b_h, its own parameter: the init schemes zero the biases of Linear layers
            self.forget_bias = nn.Parameter(torch.full((self.n_head,), float(forget_bias)))
        self.mem_k = nn.Parameter(torch.randn(self.n_kv_head, mem_kv, qk_dim)) if mem_kv else None
        self.mem_v = nn.Parameter(torch.randn(self.n_kv_head, mem_kv, self.v_dim)) if mem_kv else None
        self.xsa = None if xsa is None else ExclusiveSelfAttention(xsa, self.n_head)
        # attention.key_offset: the keys' unrotated dims from this one on are the previous position's (record 49)
        self.key_offset = key_offset
        if key_offset:
            check_key_offset(cfg.position)
        self.qk_map: nn.Module | None = None  # a map (q, k) -> (q, k) after the rotation (norm=ngpt's sphere and s_qk)
        # attention.paired_heads: heads h and h + n_head/2 as one head over twice the positions (record 58)
        self.paired = paired_layer(paired_heads, layer, cfg, self.no_paired_heads,
                                   {"sinks": sinks, "forget_gate": forget_gate, "mem_kv": mem_kv})
        if self.paired:
            self.no_qk_clip = "attention.paired_heads: a logit of a pair is one head's query against the other's key"

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
        n += ((params.get("gate_channels") or cfg.d_model) + cfg.bias) * gate_width(params.get("gate"), nh, hd)
        n += nh * bool(params.get("sinks"))
        n += extra_params(cfg, params, kv * (hd + hd))
        return Geometry(heads=nh, head_dim=hd, cache_width=2 * kv * hd + nh * bool(params.get("forget_gate")),
                        attn_width=2 * nh * hd, n_params=n)

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
        if self.paired:  # at the slots' positions, 2t and 2t + 1
            q, k = rotate_paired(pos, q, k, offset, doc, self.layer)
        else:
            q, k = pos.rotate(q, k, offset, doc, self.layer)
        if self.key_offset:
            k = shift_keys(k, pos.rot_dim, offset, doc if self.doc_mask else None, cache if mix else None)
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
        forget = self.forgetting(x, cache)  # the queries' and the keys' cumulative log forget gates, or None
        docs = None if not self.doc_mask else (doc[:, offset:], doc[:, doc.size(1) - k.size(-2):])  # queries', keys'
        y = self.mix(q, k, v, pos, offset, docs, forget)  # (B, nh, T, hs)
        if self.xsa is not None:  # each head's output less its share along the token's own value (attention.xsa)
            y = self.xsa(y, v)
        if cache is not None and self.window is not None:
            cache.keep_last(self.window - 1)  # all the next token's window reaches
        if self.gate is not None:  # (B, T, nh·hs or nh) -> (B, nh, T, hs or 1)
            y = y * torch.sigmoid(self.gate(x[..., :self.gate_channels])).view(B, T, self.n_head, -1).transpose(1, 2)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.v_dim))

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: Position, offset: int,
            docs: tuple[torch.Tensor, torch.Tensor] | None,
            forget: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The values weighed: q (B, nh, T, hs), k and v (B, nkv, S, hs) -> (B, nh, T, hs); `forget`: the forget gate's
        cumulative sums (`forgetting`)."""
        if self.paired:
            return paired_attend(q, k, v, self.score, self.scale, pos, offset, self.dropout if self.training else 0.0,
                                 self.window, self.softcap, docs)
        return attend(q, k, v, self.score, self.scale, pos, offset, self.dropout if self.training else 0.0,
                      self.window, self.softcap, docs, self.sink, self.memory(), forget)

    def memory(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The memory keys and values (nkv, M, d), (nkv, M, dv) (`mem_kv`), the keys q/k-normed as the tokens' are
        (x-transformers does the same); None without."""
        if self.mem_k is None:
            return None
        k = self.mem_k if self.k_norm is None else F.rms_norm(self.mem_k, (self.head_dim,), self.k_norm,
                                                                self.qk_norm_eps)
        return k, self.mem_v

    def forgetting(self, x: torch.Tensor, cache: LayerCache | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The forget gate's cumulative sums c_t = Σ_{l≤t} log σ(w_h·x_l + b_h), in fp32 at least, as FoX's: of these
        T tokens (B, nh, T) and of every key read (B, nh, S), the cached ones' first; None without the gate."""
        if self.forget is None:
            return None
        dtype = torch.promote_types(x.dtype, torch.float32)
        log_f = F.logsigmoid(self.forget(x).to(dtype) + self.forget_bias.to(dtype))  # (B, T, nh)
        c = log_f.cumsum(dim=1).transpose(1, 2)  # (B, nh, T)
        return (c, c) if cache is None else cache.append_forget(c)

    no_qk_clip: str | None = None  # why optim.qk_clip cannot rescale this option's logits (None: it can)

    @property
    def causal_only(self) -> str | None:
        """Why this layer cannot read the keys after a query (head=mlm refuses it; None: it can, every path reads the
        position scheme's `causal`): a window or a forget gate is defined on the past."""
        if self.window is not None:
            return (f"attention.window / attention.pattern give a layer a window of its last {self.window} keys, "
                    f"defined on the causal past: use attention.window=null and attention.pattern=null")
        if self.forget is not None:
            return ("attention.forget_gate=true decays each key by the gates between it and a later query (FoX), "
                    "which has no form for the keys after a query: use attention.forget_gate=false")
        return None

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
        if self.mem_k is not None:  # the memory keys of each key head, as its rows
            self.mem_k.mul_(k_scale.to(self.mem_k)[:, None, None])

    @property
    def sums_to_one(self) -> bool:
        """Whether each row of the weights (`probs`), with a sink's share beside it, is a distribution: the score's,
        unless memory keys take a share (`probs` shows the tokens' weights only)."""
        return self.score.sums_to_one and self.mem_k is None

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
        if self.paired:  # each token's two slots summed
            return paired_weights(q, k, self.score, self.scale if scale is None else scale, pos, self.window,
                                  self.softcap, doc if self.doc_mask else None)
        mem = self.memory()
        n_mem = 0 if mem is None else mem[0].size(-2)
        if mem is not None:
            k = memory_first(mem[0], k)
        k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)  # (B, nh, n_mem + T, hs)
        weights, logits = explicit_weights(q, k, self.score, self.scale if scale is None else scale, pos, 0,
                                           self.window, self.softcap, (doc, doc) if self.doc_mask else None,
                                           self.sink, self.forgetting(x), n_mem)
        return weights[..., n_mem:], logits.amax(dim=(-2, -1))


def extra_params(cfg: GPTConfig, params: dict[str, Any], mem_width: int) -> int:
    """The weights of the forget gate (w_h, b_h per head) and of the memory keys and values (`mem_kv` of them, each
    `mem_width` numbers over the key/value heads)."""
    return (cfg.d_model + 1) * cfg.n_head * bool(params.get("forget_gate")) + params.get("mem_kv", 0) * mem_width


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


OPTIONS = {"mha": MHA, "gqa": GQA, "mqa": MQA}
