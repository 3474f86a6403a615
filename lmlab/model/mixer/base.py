"""What every token mixer other than softmax attention shares: its geometry record, the document resets of its
recurrent state, and the short causal convolution the field's linear mixers put before their projections' use
(Gated DeltaNet, Mamba-2).

A recurrent mixer keeps a fixed-size state per sequence: when generating, `LayerCache.state` holds it (a dict of
tensors the mixer owns, e.g. `{"conv": ..., "ssm": ...}`) in place of keys and values, so its bytes do not grow with
the text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MixerGeometry:
    """A mixer layer from its sizes and keys alone (nothing built): what the size bound, the FLOPs and the cache
    report read."""

    n_params: int  # weights (gains aside: a lower bound within 1%)
    state_numbers: int  # numbers its generation state holds per sequence (recurrent state + conv window): constant in T
    flops_per_token: int  # forward FLOPs per token beyond its nn.Linear matmuls (the recurrence, chunked form)


def segment_starts(doc: torch.Tensor | None, offset: int, T: int) -> torch.Tensor | None:
    """(B, T) bool: where a new document starts among these T tokens (the first token of the text counts as no start:
    there is no state before it). `doc` (B, offset + T): every position's document number, or None."""
    if doc is None:
        return None
    here = doc[:, offset:offset + T]
    before = doc[:, offset - 1:offset + T - 1] if offset > 0 else torch.cat((here[:, :1], here[:, :-1]), dim=1)
    return here != before


def recurrent_inputs(x: torch.Tensor, cache: object | None, doc: torch.Tensor | None, doc_reset: bool
                     ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None, torch.dtype]:
    """What a recurrent mixer's forward starts from, for `x` (B, T, d): the state it continues (the cache's
    `LayerCache.state`, filled in place; a fresh dict without a cache), where documents start among these T tokens
    (None without document ids or with `doc_reset` off) and its recurrence's dtype (float32, float64 for float64 `x`:
    bf16 autocast leaves the state in float32)."""
    offset, state = (0, {}) if cache is None else (cache.offset, cache.state)
    starts = segment_starts(doc, offset, x.size(1)) if doc_reset else None
    return state, starts, torch.float64 if x.dtype == torch.float64 else torch.float32


def log_uniform_dt_bias(n: int, dt_min: float, dt_max: float, floor: float) -> torch.Tensor:
    """n biases whose softplus is a step dt drawn log-uniformly in [dt_min, dt_max] (clamped below at `floor`): Mamba's
    init of dt_bias, softplus⁻¹(dt) = dt + log(-expm1(-dt))."""
    log_dt = torch.rand(n) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)
    dt = torch.exp(log_dt).clamp(min=floor)
    return dt + torch.log(-torch.expm1(-dt))


def varlen(starts: torch.Tensor, state: torch.Tensor | None
           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The B rows of T tokens cut at their document starts `starts` (B, T) into N segments of the B·T tokens laid end
    to end, as the varlen kernels take them (FlashAttention's `cu_seqlens`, fla's). Returns cu_seqlens (N + 1,), the
    segments' initial states (N, ...): each row's first segment continues the row's `state` (B, ...) unless a document
    starts at its first token, the others start empty (None without a state), and `last` (B,): each row's last
    segment, whose final state is the row's. Counting the segments reads them to the host (one sync)."""
    B, T = starts.shape
    begins = starts.clone()
    begins[:, 0] = True  # every row begins a segment
    at = begins.flatten().nonzero().squeeze(1)  # (N,): each segment's first token, in the flattened B·T
    cu_seqlens = torch.cat((at, at.new_tensor([B * T])))
    per_row = begins.sum(1)
    ends = per_row.cumsum(0)  # (B,): the segments up to each row's end
    if state is None:
        return cu_seqlens, None, ends - 1
    kept = state * (~starts[:, 0]).to(state.dtype).view(B, *(1,) * (state.dim() - 1))
    initial = state.new_zeros(at.numel(), *state.shape[1:]).index_copy(0, ends - per_row, kept)
    return cu_seqlens, initial, ends - 1


@dataclass(frozen=True)
class Chunks:
    """The chunked form's layout of T tokens in chunks of c (the delta rules of gdn and kda): n chunks, the last padded
    by `pad`; `causal` (c, c) j <= i; `mask` (b, 1, n, c, c) j <= i in i's document; `carry` (b, 1, n, c) whether the
    incoming state reaches token i (no document start before it in the chunk); `last` whether token j reaches the
    chunk's end (it is in the chunk's last document)."""

    n: int
    c: int
    pad: int
    causal: torch.Tensor
    mask: torch.Tensor
    carry: torch.Tensor
    last: torch.Tensor

    @classmethod
    def of(cls, b: int, T: int, chunk: int, starts: torch.Tensor | None, device: torch.device) -> Chunks:
        """`starts` (b, T): document starts (None: one document)."""
        c = min(chunk, T)
        n = -(-T // c)
        pad = n * c - T
        causal = torch.ones(c, c, dtype=torch.bool, device=device).tril()
        mask = causal.expand(b, 1, n, c, c)
        carry = last = torch.ones(b, 1, n, c, dtype=torch.bool, device=device)
        if starts is not None:
            seg = F.pad(starts, (0, pad)).reshape(b, 1, n, c).long().cumsum(-1)  # documents begun in the chunk so far
            mask = mask & (seg[..., :, None] == seg[..., None, :])
            carry, last = seg == 0, seg == seg[..., -1:]
        return cls(n, c, pad, causal, mask, carry, last)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        """(b, h, T, ...) -> (b, h, n, c, ...), zero-padded."""
        return F.pad(t, (0, 0) * (t.dim() - 3) + (0, self.pad)).unflatten(2, (self.n, self.c))


def across_chunks(Wv: torch.Tensor, Wk: torch.Tensor, qd: torch.Tensor, scores: torch.Tensor, kd: torch.Tensor,
                  keep: torch.Tensor, state: torch.Tensor | None, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rules' inter-chunk recurrence, one step per chunk, from the per-chunk pieces (b, h, n, ...): the
    pseudo-values U = W_v − W_k S, the outputs qd·S + scores·U, the state keep ⊙ S + kdᵀ U (`keep` (b, h, n, dk or 1):
    what of S the chunk's end keeps, per key channel or per head). Returns o (b, h, T, dv) and the final state."""
    b, h, _, _, dk = qd.shape
    S = qd.new_zeros(b, h, dk, Wv.size(-1)) if state is None else state.to(qd.dtype)
    out = []
    for i in range(qd.size(2)):
        U = Wv[:, :, i] - Wk[:, :, i] @ S
        out.append(qd[:, :, i] @ S + scores[:, :, i] @ U)
        S = keep[:, :, i, :, None] * S + kd[:, :, i].transpose(-1, -2) @ U
    return torch.stack(out, 2).flatten(2, 3)[:, :, :T], S


class Recurrent(nn.Module):
    """What every recurrent mixer option is: the block's `mix` sublayer (the monitor's grad/norm/layer_XX/mix), called
    as (x, pos, cache, doc), reading no positions, its path chosen by `self.backend` (lmlab.model.mixer.backend)."""

    sublayer = "mix"
    mixes_tokens = True
    backend: object  # its MixerBackend, set by the option

    @property
    def backend_used(self) -> str | None:
        """The path the last forward ran (torch or a kernel; None before any): what a run reports of the mixer."""
        return self.backend.used


class ShortConv(nn.Module):
    """A depthwise causal convolution of kernel `size` over the sequence, then SiLU (Mamba's and GDN's conv1d): each
    channel mixes its last `size` tokens. With a `state` (B, C, size - 1), the tokens before these continue it; the
    returned state is the last size - 1 inputs. `starts` (B, T): document starts, where the window is cut (tokens of
    an earlier document read as zeros, in these tokens' windows and in the state the next ones continue from)."""

    def __init__(self, channels: int, size: int, bias: bool = False, activation: bool = True) -> None:
        super().__init__()
        self.size, self.activation = size, activation
        self.conv = nn.Conv1d(channels, channels, size, groups=channels, bias=bias, padding=0)

    def forward(self, x: torch.Tensor, state: torch.Tensor | None = None, starts: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, C) -> (B, T, C) and the new state (B, C, size - 1)."""
        B, T, C = x.shape
        xt = x.transpose(1, 2)  # (B, C, T)
        past = xt.new_zeros(B, C, self.size - 1) if state is None else state.to(xt.dtype)
        full = torch.cat((past, xt), dim=-1)  # (B, C, size - 1 + T)
        if starts is not None and starts.any():
            # token t reads inputs t - size + 1 .. t; those before its document's start are zeros
            full = _cut_windows(full, starts, self.size)
            y = (full * self.conv.weight[:, 0].to(full.dtype)[None, :, None, :]).sum(-1)  # (B, C, T)
            if self.conv.bias is not None:
                y = y + self.conv.bias[None, :, None]
        else:
            y = F.conv1d(full, self.conv.weight, self.conv.bias, groups=C)
        new_state = full_state(past, xt, self.size)
        if starts is not None:
            new_state = _cut_state(new_state, starts)
        y = y.transpose(1, 2)
        return (F.silu(y) if self.activation else y), new_state


def full_state(past: torch.Tensor, xt: torch.Tensor, size: int) -> torch.Tensor:
    """The last size - 1 inputs (B, C, size - 1) after these tokens."""
    return torch.cat((past, xt), dim=-1)[..., -(size - 1):] if size > 1 else past[..., :0]


def _cut_state(state: torch.Tensor, starts: torch.Tensor) -> torch.Tensor:
    """The state (B, C, size - 1), the last size - 1 inputs, with those before the last document start among these T
    tokens zeroed: the next tokens' windows must not reach into the earlier document either."""
    T, k1 = starts.size(1), state.size(-1)
    idx = torch.arange(T, device=starts.device)
    last = torch.where(starts, idx, torch.full_like(idx, -1)).amax(1, keepdim=True)  # (B, 1); -1: no start
    slot = T - k1 + torch.arange(k1, device=starts.device)  # the token each slot holds (< 0: one before these)
    return state * ((last < 0) | (slot >= last))[:, None].to(state.dtype)


def _cut_windows(full: torch.Tensor, starts: torch.Tensor, size: int) -> torch.Tensor:
    """(B, C, size - 1 + T) -> (B, C, T, size): token t's window, inputs before its document's start zeroed."""
    B, C, L = full.shape
    T = L - (size - 1)
    windows = full.unfold(-1, size, 1)  # (B, C, T, size): window t = inputs t - size + 1 .. t (in `full`'s frame)
    # the position (in these T tokens) of the latest start at or before t; -1: none among them
    idx = torch.arange(T, device=full.device).expand(B, T)
    last_start = torch.where(starts, idx, torch.full_like(idx, -1)).cummax(dim=1).values  # (B, T)
    # window slot s of token t reads token t - (size - 1) + s; keep it when that is >= last_start (or no start)
    src = idx[..., None] - (size - 1) + torch.arange(size, device=full.device)  # (B, T, size)
    keep = (last_start[..., None] < 0) | (src >= last_start[..., None])
    return windows * keep[:, None].to(windows.dtype)
