"""Positional schemes.

Contract: `Position(dim, head_dim, n_head, max_seq_len, train_len, scaling, *, <own params>)` with three
hooks, each a no-op unless the scheme overrides it, so `gpt.py` never asks which scheme it has:
- `embed(x, offset=0, doc=None)`: add absolute position information to the token embeddings, x (B, T, C);
- `rotate(q, k, offset=0, doc=None, layer=None)`: rotate queries and keys, (B, nh, T, hs) each, in layer `layer`;
- `attn_bias(T, device, dtype, offset=0)`: an additive (nh, T, offset + T) bias on the attention logits, or None.
`offset` is the position of the first of the T tokens: 0 for a whole text, the number of tokens already in the
KV cache when generating. `cache_key(length)` says when cached keys go stale: it changes with the text's length
only for schemes whose frequencies do (dynamic RoPE scalings), and a cache built under another key is rebuilt.
`extrapolates` says whether the scheme can run past the length it was trained at without a scaling method.
`doc` (B, offset + T) numbers the documents of a packed block (lmlab.model.attention.mask.documents) when the model has
an
end-of-document token; the schemes with `per_document=true` (sinusoidal, learned, RoPE) then count positions from each
document's first token instead of the block's.
`scaling` is the `rope_scaling` config; only RoPE accepts anything but `none`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch
from torch import nn

from lmlab.model.attention.mask import doc_positions
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

    @classmethod
    def n_params(cls, dim: int, max_seq_len: int) -> int:
        """The weights the scheme learns, from the sizes alone (lmlab.model.resolve.n_params_estimate)."""
        return 0

    per_document = False  # positions count from each document's start (the schemes that take `per_document`)

    def embed(self, x: torch.Tensor, offset: int = 0, doc: torch.Tensor | None = None) -> torch.Tensor:
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0, doc: torch.Tensor | None = None,
               layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def positions(self, T: int, offset: int, doc: torch.Tensor | None) -> torch.Tensor | None:
        """(B, T) the tokens' positions within their documents under `per_document`, else None (offset .. offset +
        T - 1 for every sequence)."""
        if not self.per_document:
            return None
        if doc is None:
            raise ValueError("position.per_document=true needs the documents: set data.eod (the end-of-document "
                             "token they are found by)")
        return doc_positions(doc, T)

    def attn_bias(self, T: int, device: torch.device, dtype: torch.dtype, offset: int = 0) -> torch.Tensor | None:
        return None

    def cache_key(self, length: int) -> object:
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
                 scaling: Mapping[str, Any], *, base: PositiveFloat = 10000.0, per_document: bool = False) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.dim, self.base, self.per_document = dim, base, per_document

    def table(self, T: int, device: torch.device) -> torch.Tensor:
        t = torch.arange(T, device=device, dtype=torch.float32)[:, None]  # (T, 1)
        inv = self.base ** (-torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)  # (C/2,)
        pe = torch.zeros(T, self.dim, device=device)
        pe[:, 0::2] = torch.sin(t * inv)
        pe[:, 1::2] = torch.cos(t * inv[: self.dim // 2])
        return pe

    def embed(self, x: torch.Tensor, offset: int = 0, doc: torch.Tensor | None = None) -> torch.Tensor:
        table = self.table(offset + x.size(1), x.device).to(x.dtype)
        at = self.positions(x.size(1), offset, doc)
        return x + (table[offset:] if at is None else table[at])


class Learned(Position):
    """A learned table of absolute position embeddings (GPT-2's `wpe`); it ends at max_seq_len."""

    extrapolates = False
    table_bound = True

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, per_document: bool = False) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.wpe = nn.Embedding(max_seq_len, dim)
        self.per_document = per_document

    @classmethod
    def n_params(cls, dim: int, max_seq_len: int) -> int:
        return max_seq_len * dim  # the table: an HF config's n_positions=10^9 is 10^9 x n_embd of it

    def embed(self, x: torch.Tensor, offset: int = 0, doc: torch.Tensor | None = None) -> torch.Tensor:
        at = self.positions(x.size(1), offset, doc)
        if at is not None:  # within documents: never past the block's length either
            return x + self.wpe.weight[at]
        T = offset + x.size(1)
        if T > self.wpe.num_embeddings:
            raise ValueError(
                f"position=learned has a table of {self.wpe.num_embeddings} positions (model.max_seq_len); it cannot "
                f"embed a sequence of {T}. Use a scheme that extrapolates (position=rope|alibi|none) for longer inputs."
            )
        return x + self.wpe.weight[offset:T]


class RoPE(Position):
    """Rotary position embedding (Su et al., 2021).

    Rotates the first `rotary_pct` of each head's dims by angles t·θ_j, so q·k depends only on the offset;
    `layout` says which dims rotate together at frequency θ_j: `half` (GPT-NeoX, Llama, transformers' rotate_half:
    dims j and j + d/2) or `pairs` (the paper's, RoFormer's and GPT-J's: adjacent dims 2j and 2j + 1). The two are the
    same function up to a fixed permutation of each head's dims, but a checkpoint of one is not a checkpoint of the
    other;
    `nope_layers` (0-based) are left unrotated: NoPE layers among RoPE ones (iRoPE).
    The frequencies come from the `rope_scaling` option: static ones are computed once, dynamic ones
    (`fn.dynamic = True`) per forward from the current length. cos/sin tables are cached per length.
    """

    extrapolates = False
    accepts_scaling = True

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, theta: PositiveFloat = 10000.0,
                 rotary_pct: Annotated[float, Range(gt=0, le=1)] = 1.0, per_document: bool = False,
                 nope_layers: list[int] | None = None, layout: Literal["half", "pairs"] = "half") -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.head_dim, self.theta, self.rotary_pct, self.layout = head_dim, theta, rotary_pct, layout
        self.per_document = per_document
        self.nope_layers = frozenset(nope_layers or ())  # layers left unrotated: no positions at all (iRoPE)
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

    def cache_key(self, length: int) -> object:
        """Static frequencies never change; dynamic ones at a length where they differ from the last ones."""
        if not self.dynamic:
            return None
        inv_freq, factor = self.frequencies(length)
        return tuple(inv_freq.tolist()), factor

    def _tables(self, T: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """(cos, sin, signed sin), each (T, d), for the frequencies of a text of length T; signed sin = cat(−sin,
        sin) over the two halves, for `_rotate`. Static tables are built once for the longest length asked and
        sliced (the rows don't depend on T); dynamic ones are kept for the last few lengths. Under torch.compile they
        are computed in the graph instead (a few ops on (T, d), fused by the compiler): the cache's key asks
        torch.is_inference_mode_enabled(), which dynamo cannot trace, so every layer's rotation was a graph break."""
        if torch.compiler.is_compiling():
            inv_freq, factor = self.frequencies(T) if self.dynamic else (self.inv_freq, self.attention_factor)
            return self._build(T, inv_freq, factor, device, dtype, self.layout)
        mode = (device, dtype, torch.is_inference_mode_enabled())  # inference tensors can't enter autograd
        if self.dynamic:
            key = (T, *mode)
            if key not in self._cache:
                if len(self._cache) >= 8:  # generation asks for every length in turn
                    self._cache.pop(next(iter(self._cache)))
                self._cache[key] = self._build(T, *self.frequencies(T), device, dtype, self.layout)
            return self._cache[key]
        tables = self._cache.get(mode)
        if tables is None or tables[0].size(0) < T:
            tables = self._cache[mode] = self._build(T, self.inv_freq, self.attention_factor, device, dtype,
                                                     self.layout)
        return tuple(t[:T] for t in tables)

    @staticmethod
    def _build(T: int, inv_freq: torch.Tensor, factor: float, device: torch.device, dtype: torch.dtype,
               layout: str = "half") -> tuple[torch.Tensor, ...]:
        t = torch.arange(T, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq.to(device))  # (T, d/2)
        if layout == "pairs":  # dims 2j and 2j + 1 at θ_j; the partner's sign: − on the even dim, + on the odd
            emb = freqs.repeat_interleave(2, dim=-1)  # (T, d)
            cos, sin = (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
            return cos, sin, sin * torch.tensor([-1.0, 1.0], device=device, dtype=dtype).repeat(sin.size(-1) // 2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, d)
        cos, sin = (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
        half = sin.size(-1) // 2
        return cos, sin, torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)

    def _apply(self, fn, recurse: bool = True):  # a device/dtype move invalidates the cached tables
        self._cache = {}
        return super()._apply(fn, recurse)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0, doc: torch.Tensor | None = None,
               layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        if layer in self.nope_layers:  # a NoPE layer among rotary ones (Llama 4's iRoPE, every 4th layer)
            return q, k
        cos, _, signed_sin = self._tables(offset + q.size(-2), q.device, q.dtype)  # (offset + T, d)
        at = self.positions(q.size(-2), offset, doc)
        if at is None:
            cos, signed_sin = cos[offset:], signed_sin[offset:]  # (T, d): the rows of these tokens' positions
        else:  # (B, 1, T, d): each token's row at its position within its document
            cos, signed_sin = cos[at][:, None], signed_sin[at][:, None]
        rotate = _rotate_pairs if self.layout == "pairs" else _rotate
        return rotate(q, cos, signed_sin, self.rot_dim), rotate(k, cos, signed_sin, self.rot_dim)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, d: int) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin on the first d dims of the head; the rest pass through (partial rotary).

    rotate_half(x)·sin = cat(−x2, x1)·sin = cat(x2, x1)·cat(−sin, sin): with the sign in the cached table the
    rotation is one mul, one cat and one addcmul, with no negated copy of x (3 passes over q instead of 5).
    """
    rot, rest = x[..., :d], x[..., d:]
    x1, x2 = rot.chunk(2, dim=-1)
    rotated = torch.addcmul(rot * cos, torch.cat((x2, x1), dim=-1), signed_sin)
    return torch.cat((rotated, rest), dim=-1) if rest.numel() else rotated


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, d: int) -> torch.Tensor:
    """The adjacent-pairs layout: (x_2j, x_2j+1) ← (x_2j·cos − x_2j+1·sin, x_2j+1·cos + x_2j·sin) on the first d dims,
    each pair's partner swapped in and the sign in the table (cat-free: a view of the pairs, flipped)."""
    rot, rest = x[..., :d], x[..., d:]
    swapped = rot.unflatten(-1, (d // 2, 2)).flip(-1).flatten(-2)
    rotated = torch.addcmul(rot * cos, swapped, signed_sin)
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

    def attn_bias(self, T: int, device: torch.device, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        i = torch.arange(offset, offset + T, device=device)  # the queries' positions
        j = torch.arange(offset + T, device=device)  # the keys': every token so far
        dist = (j[None, :] - i[:, None]).to(torch.float32)  # (T, offset + T): j - i, <= 0 in the causal part
        bias = self.slopes.to(device)[:, None, None] * dist  # (nh, T, offset + T)
        return bias.masked_fill(dist > 0, float("-inf")).to(dtype)


def causal_distances(T: int, offset: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, offset + T) distances i − j from the queries at offset .. offset + T − 1 to every key so far, and the
    mask of the future keys (j > i), for the learned biases below."""
    i = torch.arange(offset, offset + T, device=device)[:, None]
    dist = i - torch.arange(offset + T, device=device)[None, :]
    return dist, dist < 0


def t5_bucket(distance: torch.Tensor, num_buckets: int, max_distance: int) -> torch.Tensor:
    """T5's unidirectional bucket of a distance n = i − j (Raffel et al., 2020; `_relative_position_bucket` with
    bidirectional=False): n itself below E = num_buckets / 2, then E + ⌊ln(n / E) / ln(max_distance / E) · (num_buckets
    − E)⌋, logarithmic up to max_distance, and the last bucket at and beyond it. Negative n (the future) is bucket 0."""
    exact = num_buckets // 2
    n = distance.clamp(min=0)
    log = torch.log(n.clamp(min=exact).float() / exact) / math.log(max_distance / exact) * (num_buckets - exact)
    return torch.where(n < exact, n, (exact + log.long()).clamp(max=num_buckets - 1))


class T5Bias(Position):
    """T5's relative position bias (Raffel et al., 2020): logit(i, j) += table[bucket(i − j), h], one learned
    (num_buckets, n_head) table, shared by every layer as T5 computes it in its first layer and passes it on.

    Buckets are T5's causal ones (`t5_bucket`): exact below num_buckets / 2, logarithmic up to `max_distance`, one
    bucket for everything further, so any length runs. T5 adds the bias to unscaled logits (its init absorbs 1/√d); here
    it is added after the 1/√d scale, in the same logit units. The table is an nn.Embedding: the model's `init` sets it
    (init=gpt2: N(0, 0.02)), without weight decay, in the optimizer's `rest` group. transformers has no decoder-only
    architecture with T5's bias (T5 and its kin are encoder-decoders), so `export=hf` refuses position=t5."""

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, num_buckets: Annotated[int, Range(ge=2)] = 32,
                 max_distance: Annotated[int, Range(ge=2)] = 128) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        if max_distance <= num_buckets // 2:
            raise ValueError(f"position.max_distance={max_distance} must exceed position.num_buckets / 2 = "
                             f"{num_buckets // 2}, the distances given a bucket each; the log buckets span the rest")
        self.num_buckets, self.max_distance = num_buckets, max_distance
        self.table = nn.Embedding(num_buckets, n_head)

    @classmethod
    def attention_bytes(cls, n_head: int, T: int, batch: int) -> int:
        # attn_bias: int64 distances and buckets, float32 logs, a bool mask, then the gathered (T, T, nh) bias and its
        # masked copy; SDPA's math path with an explicit mask as under ALiBi (counted, not measured)
        return T * T * (29 + 8 * n_head) + 8 * batch * n_head * T * T

    def attn_bias(self, T: int, device: torch.device, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        dist, future = causal_distances(T, offset, device)
        bias = self.table(t5_bucket(dist, self.num_buckets, self.max_distance)).permute(2, 0, 1)  # (nh, T, offset + T)
        return bias.masked_fill(future, float("-inf")).to(dtype)


class XPos(Position):
    """xPos (Sun et al., 2022, "A Length-Extrapolatable Transformer"): RoPE whose pairs also scale, q_n by ζ_j^(n/B) and
    k_m by ζ_j^(−m/B), so q_n·k_m carries ζ_j^((n − m)/B) and decays with the distance; ζ_j = (j / (d/2) + γ) / (1 + γ)
    for pair j = 0 .. d/2 − 1 (γ = `gamma`, B = `scale_base`), rotated at θ_j = theta^(−2j/d) as RoPE.

    Layout: the paper's and torchscale's (`rotate_every_two`), adjacent dims 2j and 2j + 1 rotate and scale together
    (position.layout=pairs of RoPE). Positions count from 0 for queries and keys alike, so the scales depend on n and m
    themselves and a cached key never goes stale; torchscale centres the exponent on the middle of the current length
    instead (the same q·k, as it depends on n − m only, but its keys are rescaled at every step). A key at position m
    is multiplied by ζ_0^(−m/B), which outgrows the dtype's range (fp32 and bf16 past ~35k tokens at B = 512, fp16 past
    ~3.9k): such a length is refused. Without the paper's blockwise causal attention it does not extrapolate."""

    extrapolates = False

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, theta: PositiveFloat = 10000.0, gamma: PositiveFloat = 0.4,
                 scale_base: PositiveFloat = 512.0) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        if head_dim % 2:
            raise ValueError(f"position=xpos rotates pairs of dims: the head dim (model.d_model / model.n_head) = "
                             f"{head_dim} is odd; choose d_model and n_head giving an even head dim")
        j = torch.arange(0, head_dim, 2, dtype=torch.float32)  # 2j
        self.register_buffer("inv_freq", theta ** (-j / head_dim), persistent=False)  # θ_j
        self.register_buffer("zeta", (j / head_dim + gamma) / (1 + gamma), persistent=False)  # ζ_j
        self.scale_base, self.head_dim, self.min_zeta = scale_base, head_dim, gamma / (1 + gamma)  # ζ_0

    def rotate(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0, doc: torch.Tensor | None = None,
               layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        end = offset + q.size(-2)
        if (end - 1) / self.scale_base * -math.log(self.min_zeta) > -math.log(torch.finfo(q.dtype).tiny):
            raise ValueError(f"position=xpos at length {end}: the scale ζ^(±n/B) leaves {q.dtype}'s range (B = "
                             f"position.scale_base={self.scale_base}); use a shorter length or a larger scale_base")
        t = torch.arange(offset, end, device=q.device, dtype=torch.float32)[:, None]  # (T, 1) the tokens' positions
        angle = (t * self.inv_freq).repeat_interleave(2, dim=-1)  # (T, d): pair j at dims 2j and 2j + 1
        scale = (self.zeta ** (t / self.scale_base)).repeat_interleave(2, dim=-1)  # ζ_j^(n/B)
        d = self.head_dim
        sign = torch.tensor([-1.0, 1.0], device=q.device).repeat(d // 2)  # − on the even dim, as _rotate_pairs takes it
        cos, signed_sin = angle.cos(), angle.sin() * sign
        return (_rotate_pairs(q, (cos * scale).to(q.dtype), (signed_sin * scale).to(q.dtype), d),
                _rotate_pairs(k, (cos / scale).to(k.dtype), (signed_sin / scale).to(k.dtype), d))


class FIRE(Position):
    """FIRE (Li et al., 2023, "Functional Interpolation for Relative Positions Improves Long Context Transformers"):
    logit(i, j) += f_θ(ψ(i − j) / ψ(max(L, i)))_h for j <= i, ψ(x) = ln(|c|·x + 1), f_θ: 1 → `mlp_width` → n_head with a
    ReLU, one f_θ shared by every layer (the hook has no layer argument).

    Positions count from 0. c is learned from 0.1 and L from `init_threshold` (512, the paper's), as the paper's code
    learns it: L = |s|·init_threshold with s learned from 1, so steps move L relative to its size; ψ's denominator
    gets + 1e-6 as there. The input lies in [0, 1]: a query at i < L reads distances on the fixed scale ψ(L), one past L
    on its own ψ(i), so every longer context maps onto the range seen in training (the progressive interpolation).
    f_θ's first layer (fan-in 1) is two vectors kept at PyTorch's Linear init, U(−1, 1), as the paper's nn.Linear:
    every init scheme zeroes a Linear's bias, which would put all the ReLUs' kinks at x = 0, the input's lower end, and
    leave the units with a negative weight dead for good. The output layer is a Linear like any other (the model's
    init, weight decay, optim=muon's hidden matrices)."""

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, mlp_width: Annotated[int, Range(ge=1)] = 32,
                 init_threshold: PositiveFloat = 512.0) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.c = nn.Parameter(torch.tensor(0.1))
        self.init_threshold = init_threshold
        self.threshold_mult = nn.Parameter(torch.tensor(1.0))  # L = |s|·init_threshold
        self.w1 = nn.Parameter(torch.empty(mlp_width).uniform_(-1, 1))  # Linear(1, width): bound 1/√fan_in = 1
        self.b1 = nn.Parameter(torch.empty(mlp_width).uniform_(-1, 1))
        self.out = nn.Linear(mlp_width, n_head)

    @classmethod
    def attention_bytes(cls, n_head: int, T: int, batch: int) -> int:
        # attn_bias at the default width 32: float32 distances, ψ and its ratio, f_θ's hidden layer before and after the
        # ReLU (T, T, 32) each, the (T, T, nh) output and its masked copy; SDPA's math path as under ALiBi (counted, not
        # measured; training keeps the hidden layer of every layer's call for the backward)
        return T * T * (13 + 8 * 32 + 8 * n_head) + 8 * batch * n_head * T * T

    def psi(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.c.abs() * x + 1)

    def attn_bias(self, T: int, device: torch.device, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        dist, future = causal_distances(T, offset, device)
        i = torch.arange(offset, offset + T, device=device, dtype=torch.float32)[:, None]  # (T, 1)
        threshold = self.threshold_mult.abs() * self.init_threshold
        x = self.psi(dist.clamp(min=0).float()) / (self.psi(torch.maximum(i, threshold)) + 1e-6)  # (T, offset + T)
        bias = self.out(torch.relu(x[..., None] * self.w1 + self.b1)).permute(2, 0, 1)  # (nh, T, offset + T)
        return bias.masked_fill(future, float("-inf")).to(dtype)


POSITIONS = {"none": NoPE, "sinusoidal": Sinusoidal, "learned": Learned, "rope": RoPE, "alibi": ALiBi,
             "t5": T5Bias, "xpos": XPos, "fire": FIRE}
