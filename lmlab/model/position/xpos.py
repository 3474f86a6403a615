"""xPos: RoPE whose pairs also scale with the position."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from lmlab.model.position.base import Position
from lmlab.model.position.rope import _rotate_pairs
from lmlab.registry import PositiveFloat


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

    causal_only = ("position=xpos scales q·k by ζ^((n − m)/B), a decay toward the past that grows without bound for "
                   "the keys after a query (Sun et al., 2022); use position=rope")

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


OPTIONS = {"xpos": XPos}
