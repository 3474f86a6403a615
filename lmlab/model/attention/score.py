"""Attention score functions: how the scaled logits q·k/√d (+ the position bias) become attention weights.

Contract: `Score(train_len)` with
- `weights(logits, mask, n)`: logits (..., T, S) (scaled, position bias added), mask (T, S) True where query i may
  read key j (causal: j <= offset + i), n (T,) the number of keys each query reads (offset + i + 1) -> weights
  (..., T, S), exactly 0 where the mask is False;
- `query_scale(n)`: a factor (T,) on each query before the dot product, or None;
- `sums_to_one`: whether each row of weights sums to one (the monitor reports an entropy only then);
- `sdpa`: whether the weights are softmax(logits) after `query_scale`, so `F.scaled_dot_product_attention` (fused,
  no (T, S) matrix held) computes them.
Used by the attention (`attention.score`) and by the GAU block (`block.score`) through `attend` below, the way
the FFN uses `activation`. n counts keys per query, so a score stays causal and the KV cache (queries starting at
`offset`) gives the full forward's outputs.

Which keys a query reads is the position scheme's `causal` (lmlab.model.position.Position, the one object every
attention path is handed): True, the keys at or before it (every decoder); False, every key of the text (a
bidirectional encoder, head=mlm), where n is the text's length for every query and SDPA runs without its causal mask.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from lmlab.model.attention.flex import flex_attend, use_flex
from lmlab.model.mask import (allowed, banded_sdpa, doc_allowed, forget_bias, key_counts,  # noqa: F401
                              read_memory)  # (key_counts: as before)

if TYPE_CHECKING:
    from lmlab.model.position import Position


def log_ratio(n: torch.Tensor, train_len: int) -> torch.Tensor:
    """log_L(n) = ln n / ln L: the entropy-invariance factor (Su, 2021; Chiang & Cholak, 2022) for a query reading n
    keys, L = the trained length. Shared by `attention.logn_scaling` (clamped >= 1, past L only) and softmax_plus."""
    return n.log() / math.log(train_len)


class Softmax:
    """softmax(q·k/√d + bias) over the keys each query reads (Vaswani et al., 2017)."""

    sums_to_one = True
    sdpa = True

    def __init__(self, train_len: int) -> None:
        self.train_len = train_len

    def query_scale(self, n: torch.Tensor) -> torch.Tensor | None:
        return None

    def weights(self, logits: torch.Tensor, mask: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return logits.masked_fill(~mask, float("-inf")).softmax(dim=-1)


class SoftmaxPlus(Softmax):
    """Entropy-invariant softmax, trained with it (Su, 2021, the 'softmax_plus' of GAU-α): softmax(log_L(n) · q·k/√d
    + bias), n = the keys query i reads (i + 1), L = the trained length (`train_len`). The factor multiplies the
    content logits (the query), not a position bias, as `logn_scaling` does. It is < 1 for n < L (the first query,
    n = 1, reads its single key with weight 1 whatever the logits), 1 at n = L and > 1 beyond, so the model learns
    with it at every length, unlike the zero-shot `logn_scaling`, which only acts past L."""

    def __init__(self, train_len: int) -> None:
        if train_len < 2:
            raise ValueError(f"attention score softmax_plus needs a trained length >= 2 (log base L; got {train_len})")
        super().__init__(train_len)

    def query_scale(self, n: torch.Tensor) -> torch.Tensor:
        return log_ratio(n, self.train_len)


class ReLU2(Softmax):
    """relu²(q·k/√d + bias) / n (FLASH, Hua et al., 2022): no normalisation, rows don't sum to one.

    n is per query: the number of keys it reads (i + 1 at position i), as Su's post on GAU defines it for causal
    language models. The FLASH paper divides by the (fixed) training length; a divisor fixed to the text's length
    would make a query's output depend on how many tokens follow it, so cached generation (one token at a time) would
    not reproduce the full forward. Masked entries are 0 (the mask is applied after relu²)."""

    sums_to_one = False
    sdpa = False

    def weights(self, logits: torch.Tensor, mask: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        a = F.relu(logits.masked_fill(~mask, 0.0)).square() / n[..., None].to(logits.dtype)  # (..., T, S)
        return a.masked_fill(~mask, 0.0)


def causal_mask(T: int, offset: int, device: torch.device) -> torch.Tensor:
    """(T, offset + T) bool: query i (at position offset + i) reads keys 0 .. offset + i."""
    return allowed(T, offset, offset + T, None, device)


def explicit_weights(q: torch.Tensor, k: torch.Tensor, score: Softmax, scale: float, pos: Position,
                     offset: int = 0, window: int | None = None, softcap: float | None = None,
                     doc: tuple[torch.Tensor, torch.Tensor] | None = None, sink: torch.Tensor | None = None,
                     forget: tuple[torch.Tensor, torch.Tensor] | None = None, n_mem: int = 0,
                     heads: tuple[torch.Tensor, torch.Tensor] | None = None, select: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and the logits, materialised: q (B, h, T, d), k (B, h, n_mem + S, d), n_mem memory keys then the
    S keys ending with the last query (key heads already repeated to the query heads) -> (B, h, T, n_mem + S) each.
    `q` already carries `score.query_scale`. `window`: each query reads its last W keys
    (lmlab.model.mask); `softcap` c: the logits become c·tanh(logits / c) before the position bias and the
    mask (Gemma 2's attention-logit softcap); `doc`: the queries' and the keys' document numbers, each query reading
    its own document's keys only (lmlab.model.mask.doc_allowed); `sink` (h,): each head's learned sink
    logit, a column the softmax normalises over and that weighs no value (gpt-oss), so a row sums to less than one and
    a head can attend to nothing; `forget`: the forget gate's cumulative log gates, whose decay c_i - c_j adds to the
    logits like a position bias (lmlab.model.mask.forget_bias); `n_mem`: the memory keys in front
    (`attention.mem_kv`), which every query reads, with neither bias nor decay. A position scheme's `score_bias`
    (CoPE's) reads q and the S keys, or `heads`, the heads' own queries and keys where q·k is not one head's
    (talking heads' mixed logits), and adds to the logits as `attn_bias` does. `select` (B, h, T, S): the keys a
    content-sparse selection keeps (attention.select_blocks), read beside the causal, window and document masks."""
    T, S = q.size(-2), k.size(-2) - n_mem
    logits = (q @ k.transpose(-2, -1)) * scale  # (B, h, T, n_mem + S)
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    bias = pos.attn_bias(T, q.device, logits.dtype, offset)  # (h, T, offset + T) with -inf above the diagonal, or None
    bias = None if bias is None else bias[..., offset + T - S:]
    own_q, own_k = heads or (q, k[..., n_mem:, :])
    bias = add_bias(bias, pos.score_bias(own_q, own_k, scale, offset))  # CoPE's (B, h, T, S)
    if forget is not None:
        decay = forget_bias(forget).to(logits.dtype)  # (B, h, T, S)
        bias = decay if bias is None else bias + decay
    mask = doc_allowed(allowed(T, offset, S, window, q.device, pos.causal), doc)  # (T, S), or (B, 1, T, S) with docs
    if select is not None:
        mask = mask & select
    if bias is not None:
        logits = logits + read_memory(bias.masked_fill(~mask, 0.0), n_mem)
    n = (key_counts(T, offset, q.device, window, causal=pos.causal) if doc is None and select is None
         else mask.sum(-1).float())  # the keys each query reads
    mask = read_memory(mask, n_mem)
    masked = logits.masked_fill(~mask, float("-inf"))
    if sink is not None:  # softmax over the keys and the sink column, the sink's weight dropped
        column = sink.to(logits.dtype)[:, None, None].expand(*logits.shape[:-1], 1)
        return torch.exp(masked - torch.cat((masked, column), dim=-1).logsumexp(-1, keepdim=True)), masked
    return score.weights(logits, mask, n), masked


def add_bias(bias: torch.Tensor | None, more: torch.Tensor | None) -> torch.Tensor | None:
    """The sum of two optional biases on the logits (None: no bias)."""
    return bias if more is None else more if bias is None else bias + more


def memory_first(mem: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Keys or values t (B, hkv, S, d) after the learned memory `mem` (hkv, M, d) (`attention.mem_kv`)."""
    return torch.cat((mem.to(t.dtype).expand(t.size(0), -1, -1, -1), t), dim=-2)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score: Softmax, scale: float, pos: Position,
           offset: int = 0, dropout_p: float = 0.0, window: int | None = None, softcap: float | None = None,
           doc: tuple[torch.Tensor, torch.Tensor] | None = None, sink: torch.Tensor | None = None,
           mem: tuple[torch.Tensor, torch.Tensor] | None = None,
           forget: tuple[torch.Tensor, torch.Tensor] | None = None, select: torch.Tensor | None = None
           ) -> torch.Tensor:
    """weights(q·k·scale + bias) @ v: q (B, h, T, d), k (B, hkv, S, d), v (B, hkv, S, dv) -> (B, h, T, dv), the S keys
    ending with the last query. `q` already carries `score.query_scale`. Softmax scores take SDPA's fused kernels
    (causal when there is no bias and no cached prefix, a materialised mask otherwise; a window that cuts the context
    block by block, lmlab.model.mask.banded_sdpa, in O(T·W); documents as a (B, 1, T, S) mask); the others,
    and softcapped logits and sinks, are computed explicitly. On the GPU (lmlab.model.attention.flex.use_flex),
    softmax under a window, documents or a softcap runs through FlexAttention instead: one kernel, its mask a
    function, never dense. `mem`: learned memory keys and values (hkv, M, d), (hkv, M, dv) that every query reads
    (`attention.mem_kv`); `forget`: the forget gate's cumulative log gates (`attention.forget_gate`;
    lmlab.model.mask.forget_bias), a (B, h, T, S) bias; both take lmlab's SDPA paths, not FlexAttention, as
    does a position scheme's `score_bias` (CoPE's (B, h, T, S) bias from q and k, a materialised mask), and `select`
    (B, h, T, S), the keys a content-sparse selection keeps (attention.select_blocks), a mask beside the causal one."""
    T, S = q.size(-2), k.size(-2)
    groups = q.size(1) // k.size(1)
    cut = window is not None and window < offset + T  # the window cuts the context somewhere
    n_mem = 0 if mem is None else mem[0].size(-2)
    if mem is not None:
        k, v = memory_first(mem[0], k), memory_first(mem[1], v)
    if (score.sdpa and sink is None and not dropout_p and (cut or doc is not None or softcap is not None)
            and mem is None and forget is None and select is None
            and use_flex(q) and pos.attn_bias(1, q.device, q.dtype) is None
            and pos.score_bias(q[..., :1, :], k[..., :1, :], scale) is None):  # on the GPU: one masked kernel
        return flex_attend(q, k, v, scale=scale, offset=offset, window=window if cut else None, doc=doc,
                           softcap=softcap, causal=pos.causal)
    if score.sdpa and softcap is None and sink is None:
        bias = pos.attn_bias(T, q.device, q.dtype, offset)  # (h, T, offset + T), -inf where j > i, or None
        if bias is not None:
            bias = bias[..., offset + T - S:]
        bias = add_bias(bias, pos.score_bias(q, k[..., n_mem:, :], scale, offset))  # CoPE's (B, h, T, S)
        if cut:
            return banded_sdpa(q, k, v, scale=scale, window=window, offset=offset, bias=bias, dropout_p=dropout_p,
                               doc=doc, forget=forget, n_mem=n_mem)
        if doc is not None or forget is not None or n_mem or select is not None:  # a mask, or -inf in the bias
            mask = doc_allowed(allowed(T, offset, S, None, q.device, pos.causal), doc)
            if select is not None:
                mask = mask & select
            if forget is not None:
                decay = forget_bias(forget).to(q.dtype)  # (B, h, T, S)
                bias = decay if bias is None else bias + decay
            bias = read_memory(mask if bias is None else bias.masked_fill(~mask, float("-inf")), n_mem)
        elif bias is None and offset and T > 1:  # SDPA's is_causal aligns to the top left: say where each query is
            bias = allowed(T, offset, S, None, q.device, pos.causal)
        causal = bias is None and not offset and pos.causal  # bidirectional: no mask at all
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=causal,
                                              dropout_p=dropout_p, scale=scale, enable_gqa=groups != 1)
    if groups != 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    a, _ = explicit_weights(q, k, score, scale, pos, offset, window, softcap, doc, sink, forget, n_mem, select=select)
    return F.dropout(a, dropout_p) @ v if dropout_p else a @ v


def per_query(factor: torch.Tensor) -> torch.Tensor:
    """A per-query factor, (T,) or (B, T) with documents, shaped to multiply queries (B, h, T, d)."""
    return factor[:, None, :, None] if factor.dim() == 2 else factor[:, None]


def scale_queries(q: torch.Tensor, score: Softmax, offset: int, window: int | None = None,
                  doc: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """q (..., T, d) times the score's per-query factor (of the keys each query reads), if it has one; `causal=False`:
    every query reads the whole text."""
    factor = score.query_scale(key_counts(q.size(-2), offset, q.device, window, doc, causal))
    return q if factor is None else q * per_query(factor.to(q.dtype))


SCORES = {"softmax": Softmax, "softmax_plus": SoftmaxPlus, "relu2": ReLU2}
