"""Positional schemes.

Contract: `Position(dim, head_dim, n_head, max_seq_len, train_len, scaling, *, <own params>)` with three
hooks, each a no-op unless the scheme overrides it, so `gpt.py` never asks which scheme it has:
- `embed(x)`: add absolute position information to the token embeddings, x (B, T, C);
- `rotate(q, k)`: rotate queries and keys, (B, nh, T, hs) each;
- `attn_bias(T, device, dtype)`: an additive (nh, T, T) bias on the attention logits, or None.
`extrapolates` says whether the scheme can run past the length it was trained at without a scaling method.
`scaling` is the `rope_scaling` config; only RoPE accepts anything but `none`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any

import torch
from torch import nn

from lmlab.model.rope_scaling import ROPE_SCALINGS, rope_frequencies  # noqa: F401  (rope_frequencies: public)
from lmlab.registry import PositiveFloat, Range, option_params


class Position(nn.Module):
    extrapolates = True  # runs past the trained length without a scaling method and stays sensible
    accepts_scaling = False  # takes a rope_scaling other than none
    table_bound = False  # cannot run past max_seq_len at all (a learned table)

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any]) -> None:
        super().__init__()
        self.max_seq_len, self.train_len = max_seq_len, train_len

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def attn_bias(self, T: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
        return None

    @classmethod
    def attention_bytes(cls, n_head: int, T: int, batch: int) -> int:
        """Memory that attention over `batch` sequences of length T needs because of this scheme (checked against
        the free memory before a length is run). 0: no bias, so attention stays on SDPA's causal kernels, whose
        memory grows with T, not T²."""
        return 0


class NoPE(Position):
    """No positional information (Kazemnejad et al., 2023): causal attention alone breaks permutation symmetry."""


class Sinusoidal(Position):
    """Fixed sinusoids added to the embeddings (Vaswani et al., 2017): PE[t, 2i] = sin(t / 10000^(2i/d)), cos at
    2i+1."""

    extrapolates = False  # defined at any length, but the model has never seen the larger angles

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, base: PositiveFloat = 10000.0) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.dim, self.base = dim, base

    def table(self, T: int, device: torch.device) -> torch.Tensor:
        t = torch.arange(T, device=device, dtype=torch.float32)[:, None]  # (T, 1)
        inv = self.base ** (-torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)  # (C/2,)
        pe = torch.zeros(T, self.dim, device=device)
        pe[:, 0::2] = torch.sin(t * inv)
        pe[:, 1::2] = torch.cos(t * inv[: self.dim // 2])
        return pe

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.table(x.size(1), x.device).to(x.dtype)


class Learned(Position):
    """A learned table of absolute position embeddings (GPT-2's `wpe`); it ends at max_seq_len."""

    extrapolates = False
    table_bound = True

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any]) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.wpe = nn.Embedding(max_seq_len, dim)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        T = x.size(1)
        if T > self.wpe.num_embeddings:
            raise ValueError(
                f"position=learned has a table of {self.wpe.num_embeddings} positions (model.max_seq_len); it cannot "
                f"embed a sequence of {T}. Use a scheme that extrapolates (position=rope|alibi|none) for longer inputs."
            )
        return x + self.wpe.weight[:T]


class RoPE(Position):
    """Rotary position embedding (Su et al., 2021), half-split layout as in GPT-NeoX / HF Llama.

    Rotates the first `rotary_pct` of each head's dims by angles t·θ_j, so q·k depends only on the offset.
    The frequencies come from the `rope_scaling` option: static ones are computed once, dynamic ones
    (`fn.dynamic = True`) per forward from the current length. cos/sin tables are cached per length.
    """

    extrapolates = False
    accepts_scaling = True

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, theta: PositiveFloat = 10000.0,
                 rotary_pct: Annotated[float, Range(gt=0, le=1)] = 1.0) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.head_dim, self.theta, self.rotary_pct = head_dim, theta, rotary_pct
        option_params("rope_scaling", ROPE_SCALINGS, scaling)  # an unknown name lists the choices
        self.scaling = dict(scaling)
        if self.scaling["name"] != "none" and self.scaling.get("original_max_len") is None:
            self.scaling["original_max_len"] = train_len  # scale relative to the length the model was trained at
        self.dynamic = getattr(ROPE_SCALINGS[self.scaling["name"]], "dynamic", False)
        inv_freq, self.attention_factor = self.frequencies(max_seq_len)
        self.rot_dim = 2 * inv_freq.numel()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def frequencies(self, seq_len: int) -> tuple[torch.Tensor, float]:
        return rope_frequencies(self.head_dim, self.theta, self.scaling, max_seq_len=self.max_seq_len, seq_len=seq_len,
                                rotary_pct=self.rotary_pct)

    def cos_sin(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self._tables(T, device, dtype)[:2]

    def _tables(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(cos, sin, signed sin), each (T, d); signed sin = cat(−sin, sin) over the two halves, for `_rotate`."""
        key = (T, device, dtype, torch.is_inference_mode_enabled())  # inference tensors can't enter autograd
        if key not in self._cache:
            if self.dynamic:
                inv_freq, factor = self.frequencies(T)
            else:
                inv_freq, factor = self.inv_freq, self.attention_factor
            t = torch.arange(T, device=device, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq.to(device))  # (T, d/2)
            emb = torch.cat((freqs, freqs), dim=-1)  # (T, d)
            cos, sin = (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
            half = sin.size(-1) // 2
            self._cache[key] = (cos, sin, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
        return self._cache[key]

    def _apply(self, fn, recurse: bool = True):  # a device/dtype move invalidates the cached tables
        self._cache = {}
        return super()._apply(fn, recurse)

    def rotate(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, _, signed_sin = self._tables(q.size(-2), q.device, q.dtype)  # (T, d)
        return _rotate(q, cos, signed_sin, self.rot_dim), _rotate(k, cos, signed_sin, self.rot_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, d: int) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin on the first d dims of the head; the rest pass through (partial rotary).

    rotate_half(x)·sin = cat(−x2, x1)·sin = cat(x2, x1)·cat(−sin, sin): with the sign in the cached table the
    rotation is one mul, one cat and one addcmul, with no negated copy of x (3 passes over q instead of 5).
    """
    rot, rest = x[..., :d], x[..., d:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.addcmul(rot * cos, torch.cat((x2, x1), dim=-1), signed_sin)
    return torch.cat((rotated, rest), dim=-1) if rest.numel() else rotated


def alibi_slopes(n_head: int) -> torch.Tensor:
    """ALiBi head slopes (Press et al., 2022): 2^(-8i/n) for i = 1..n when n is a power of two; otherwise the
    slopes of the nearest lower power of two m, then every other slope of 2m, as in the paper's code."""
    m = 2 ** math.floor(math.log2(n_head))
    base = [2 ** (-8 * i / m) for i in range(1, m + 1)]
    extra = [2 ** (-8 * i / (2 * m)) for i in range(1, 2 * m + 1)][0::2][: n_head - m]
    return torch.tensor(base + extra)


class ALiBi(Position):
    """Attention with linear biases (Press et al., 2022): logit(i, j) += -slope_h · (i − j). No embeddings."""

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

    def attn_bias(self, T: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        t = torch.arange(T, device=device)
        dist = (t[None, :] - t[:, None]).to(torch.float32)  # (T, T): j - i, <= 0 in the causal part
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
        bias = self.slopes.to(device)[:, None, None] * dist  # (nh, T, T)
        return bias.masked_fill(~causal, float("-inf")).to(dtype)


POSITIONS = {"none": NoPE, "sinusoidal": Sinusoidal, "learned": Learned, "rope": RoPE, "alibi": ALiBi}
