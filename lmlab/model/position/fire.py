"""FIRE: a learned function of the normalised relative distance, as a bias on the logits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import torch
from torch import nn

from lmlab.model.position.base import Position, causal_distances
from lmlab.registry import PositiveFloat, Range


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

    logit_bias = "position=fire adds a learned function of the distance to every logit"

    causal_only = ("position=fire is a learned function of the normalised distance to a past key, "
                   "ψ(i − j)/ψ(max(L, i)) (Li et al., 2023), with no form for the keys after a query; use "
                   "position=rope, alibi or t5")

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


OPTIONS = {"fire": FIRE}
