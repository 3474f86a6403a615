"""Rotary position embedding and its two layouts (the frequencies: lmlab.model.rope_scaling)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

import torch

from lmlab.model.position.base import Position
from lmlab.model.rope_scaling import ROPE_SCALINGS, rope_frequencies, window_yarn
from lmlab.model.steps import FollowsStep
from lmlab.registry import PositiveFloat, Range, option_params


class RoPE(FollowsStep, Position):
    """Rotary position embedding (Su et al., 2021).

    Rotates the first `rotary_pct` of each head's dims by angles t·θ_j, so q·k depends only on the offset;
    `layout` says which dims rotate together at frequency θ_j: `half` (GPT-NeoX, Llama, transformers' rotate_half:
    dims j and j + d/2) or `pairs` (the paper's, RoFormer's and GPT-J's: adjacent dims 2j and 2j + 1). The two are the
    same function up to a fixed permutation of each head's dims, but a checkpoint of one is not a checkpoint of the
    other;
    `nope_layers` (0-based) are left unrotated: NoPE layers among RoPE ones (iRoPE).
    The frequencies come from the `rope_scaling` option: static ones are computed once, dynamic ones
    (`fn.dynamic = True`) per forward from the current length. cos/sin tables are cached per length.
    `window_yarn` (the GPT-2 speedrun's record 31): YaRN applied in training at each stage of
    attention.window_schedule, the frequencies and the logits' scale a function of the windows the run has passed
    through (rope_scaling.window_yarn), and of attention.eval_window when not training: at step s, the stages begun by
    s (then the eval window); with no step (after training: evaluation, generation), every stage's.
    """

    extrapolates = False
    accepts_scaling = True

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, theta: PositiveFloat = 10000.0,
                 rotary_pct: Annotated[float, Range(gt=0, le=1)] = 1.0, per_document: bool = False,
                 nope_layers: list[int] | None = None, layout: Literal["half", "pairs"] = "half",
                 window_yarn: bool = False) -> None:
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
        self.window_yarn = window_yarn
        if window_yarn and self.scaling["name"] != "none":
            raise ValueError(f"position.window_yarn=true rescales the frequencies at each window stage in training; "
                             f"rope_scaling={self.scaling['name']} rescales them past the trained length: one or the "
                             f"other (rope_scaling=none)")
        self.windows: Any = None  # the longest layers' LayerWindows, under window_yarn (follow)
        self._yarn: tuple | None = None  # the windows the frequencies were last set for
        self._base = inv_freq.clone()  # the frequencies at the first stage's window
        self.logit_scale = 1.0  # window_yarn's scale of the attention logits (on q: every dim, rotated or not)

    def follow(self, windows: list[Any]) -> None:
        """Under window_yarn: the windows of the model's attention layers (lmlab.model.attention.parts.window.LayerWindows,
        one per attention layer), of which the scheduled ones' stages set the frequencies."""
        if not self.window_yarn:
            return
        staged = [w for w in windows if w is not None and w.stages is not None]
        if not staged:
            raise ValueError("position.window_yarn=true applies YaRN at each stage of attention.window_schedule, which "
                             "gives no stages: set attention.window_schedule=[[0, W0], [f1, W1], ...] (a window per "
                             "stage), or position.window_yarn=false")
        self.windows = staged[0]
        self._follow_step()

    def _follow_step(self) -> None:
        if self.windows is None:  # not under window_yarn: the frequencies do not move
            return
        seq = self.windows.passed(*self.step_at, self.training)
        if seq == self._yarn:
            return
        inv_freq, self.logit_scale = window_yarn(self._base, list(seq))
        with torch.no_grad():
            self.inv_freq.copy_(inv_freq.to(self.inv_freq))
        self._yarn, self._cache = seq, {}

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
        if self.logit_scale != 1.0:  # window_yarn: the record's softmax scale, on the whole logit
            q = q * self.logit_scale
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


OPTIONS = {"rope": RoPE}
