"""`residual=canon`: canon layers (Allen-Zhu, 2025, "Physics of Language Models: Part 4.1, Architecture Design and the
Magic of Canon Layers"). A canon layer mixes each channel over the last k tokens and keeps its input:

    h_t ← h_t + Σ_{i=0}^{k-1} w_i ⊙ h_{t-i}        (w_i ∈ R^d: one weight per channel and lag; k = `kernel`)

It sits on what a sublayer reads (the block's input transform, lmlab.model.placement), at the paper's positions A (the
token mixer's input: attention's or a recurrent mixer's, after its norm) and C (the FFN's input, after its norm),
`positions`. The paper's B (on q, k, v inside attention) and D (on the FFN's gate and up projections) act inside a
sublayer, which the block's hooks do not reach: refused by key. Under the placements that norm the sum (post,
deepnorm) a sublayer reads the stream itself, and the canon layer acts on that.

`init=kaiming` is the paper's code (facebookresearch/PhysicsLM4: torch's Conv1d default, w ~ U(−1/√k, 1/√k), no
bias, no activation, the residual on); `init=zero` starts each canon layer as the identity, the model the standard one
at step 0. lmlab's inits (`init=`) re-draw only Linear and Embedding weights: the canon weights keep these.

Under attention.doc_mask token t reads h_{t-i} only from its own document (the same document number), in training and
when generating. When generating, each layer's `LayerCache.inputs` holds each position's last k − 1 inputs (`canon_A`,
`canon_C`), beside its keys and values or a recurrent mixer's state. The layer is k shifted products rather than the
mixers' ShortConv (lmlab.model.mixer.base): with document starts in every packed batch that one takes its windowed
path, which keeps k copies of the input for backward and breaks a compiled graph at its data-dependent branch; these
keep one (measured on the CPU: 2 MiB saved instead of 8, 4x faster for B·T·d = 8·256·256) and compile to one graph.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.capabilities import TokenMixer
from lmlab.registry import PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import LayerCache

Position = Literal["A", "B", "C", "D"]
INSIDE = {"B": "on q, k, v inside attention", "D": "on the FFN's gate and up projections"}


class CanonLayer(nn.Module):
    """One canon layer over d channels. `weight` (d, 1, k) is laid out as the paper's depthwise Conv1d: tap k − 1 − i
    multiplies h_{t-i}."""

    def __init__(self, d_model: int, kernel: int, zero: bool) -> None:
        super().__init__()
        bound = 0.0 if zero else kernel ** -0.5  # torch's Conv1d init (Kaiming uniform, a = √5): U(−1/√k, 1/√k)
        self.weight = nn.Parameter(torch.empty(d_model, 1, kernel).uniform_(-bound, bound))

    def forward(self, h: torch.Tensor, past: torch.Tensor, keep: list[torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """h (B, T, d) after `past` (B, k − 1, d), the inputs before it (zeros before the text) -> h_t + Σ_i w_i ⊙
        h_{t-i} and the last k − 1 inputs; keep[i] (B, T, 1): whether h_{t-i} counts for token t (None: every one)."""
        k, T = self.weight.size(-1), h.size(1)
        full = torch.cat((past.to(h.dtype), h), dim=1)  # row k − 1 + t holds h_t
        w = self.weight[:, 0].to(h.dtype)  # (d, k)
        out = h
        for i in range(k):
            term = full[:, k - 1 - i:k - 1 - i + T] * w[:, k - 1 - i]  # w_i ⊙ h_{t-i}; saves a view of `full` only
            out = out + (term if keep is None else term * keep[i])
        return out, full[:, T:].clone()


class CanonLayers(nn.ModuleDict):
    """One block's canon layers by position (`A`, `C`), and `at`: which sublayer (1-based) each reads."""

    def __init__(self, at: dict[int, str], d_model: int, kernel: int, zero: bool, doc_reset: bool) -> None:
        super().__init__({p: CanonLayer(d_model, kernel, zero) for p in at.values()})
        self.at, self.kernel, self.doc_reset = at, kernel, doc_reset

    def forward(self, j: int, h: torch.Tensor, cache: LayerCache | None, doc: torch.Tensor | None) -> torch.Tensor:
        """Sublayer j's input h (B, T, d) through its canon layer, if it has one; `doc` (B, offset + T): every
        position's document number (or None)."""
        if (p := self.at.get(j)) is None:
            return h
        k, (B, T, d) = self.kernel, h.shape
        offset, past = (0, None) if cache is None else (cache.offset, cache.inputs.get(f"canon_{p}"))
        keep = None
        if self.doc_reset and doc is not None:  # h_{t-i} counts when it is in token t's document
            padded = F.pad(doc, (k - 1, 0), value=-1)  # position s's document at s + k − 1 (−1: before the text)
            here = doc[:, offset:offset + T]
            keep = [(padded[:, offset + k - 1 - i:offset + k - 1 - i + T] == here)[..., None] for i in range(k)]
        out, last = self[p](h, h.new_zeros(B, k - 1, d) if past is None else past, keep)
        if cache is not None:
            cache.inputs[f"canon_{p}"] = last
        return out


class Canon(nn.Module):
    def __init__(self, cfg: GPTConfig, *, kernel: PositiveInt = 4, positions: Sequence[Position] = ("A", "C"),
                 init: Literal["kaiming", "zero"] = "kaiming") -> None:
        super().__init__()
        if inside := [p for p in positions if p in INSIDE]:
            raise ValueError(f"residual.canon.positions={list(positions)}: canon-{inside[0]} acts "
                             f"{INSIDE[inside[0]]}, which lmlab's blocks do not expose; use positions A (the token "
                             f"mixer's input) and C (the FFN's input), e.g. residual.canon.positions=[A,C]")
        if not positions or len(set(positions)) < len(positions):
            raise ValueError(f"residual.canon.positions={list(positions)} must name A, C or both, each once")
        self.kernel, self.positions, self.zero = kernel, tuple(positions), init == "zero"
        self.d_model, self.doc_reset = cfg.d_model, bool(cfg.attention.get("doc_mask"))

    @classmethod
    def n_params(cls, cfg: GPTConfig, *, kernel: int = 4, positions: Sequence[str] = ("A", "C"),
                 init: str = "kaiming") -> int:
        """k weights per channel, per position and layer."""
        return cfg.n_layer * len(positions) * cfg.d_model * kernel

    def attach(self, model: nn.Module) -> None:
        for block in model.h:
            # A: the sublayer that mixes tokens (attention, a recurrent mixer, GAU); C: the one that does not (the FFN)
            where = {("A" if isinstance(m := getattr(block, name), TokenMixer) and m.mixes_tokens else "C"): j
                     for j, name in enumerate(block.sublayer_names, 1)}
            if missing := [p for p in self.positions if p not in where]:
                raise ValueError(f"residual.canon.positions={list(self.positions)}: block={model.cfg.block['name']!r} "
                                 f"has no sublayer for canon-{missing[0]} (A: the token mixer's input, C: the FFN's); "
                                 f"use residual.canon.positions=[{','.join(p for p in self.positions if p in where)}]")
            at = {where[p]: p for p in self.positions}
            block.add_input_transform("canon", CanonLayers(at, self.d_model, self.kernel, self.zero, self.doc_reset))


OPTIONS = {"canon": Canon}
