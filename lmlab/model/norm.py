"""Normalization layers.

Contract: `Norm(dim, *, eps, ...)` maps (..., dim) -> (..., dim), keeping dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class LayerNorm(nn.Module):
    """LayerNorm (Ba et al., 2016): (x - mean) / sqrt(var + eps) * w + b over the feature dim."""

    def __init__(self, dim: int, *, eps: float = 1e-5, affine: bool = True, bias: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich, 2019): x / sqrt(mean(x²) + eps) * w. No centring, no bias."""

    def __init__(self, dim: int, *, eps: float = 1e-6, affine: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


class ScaleNorm(nn.Module):
    """ScaleNorm (Nguyen & Salazar, 2019): g * x / max(‖x‖, eps), one learned scalar g initialised to sqrt(dim)."""

    def __init__(self, dim: int, *, eps: float = 1e-5, affine: bool = True) -> None:
        super().__init__()
        self.eps = eps
        g = torch.tensor(float(dim) ** 0.5)
        self.weight = nn.Parameter(g) if affine else None
        if not affine:
            self.register_buffer("g", g, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.weight if self.weight is not None else self.g
        return g * x / x.norm(dim=-1, keepdim=True).clamp_min(self.eps)


class BatchNorm(nn.Module):
    """BatchNorm (Ioffe & Szegedy, 2015) over every (example, position) of the batch, per feature.

    Here to show why language models don't use it: in training the statistics of position t include
    the activations of positions > t (and of other examples), so the model can read the future
    through the mean and variance — a causality leak the tests demonstrate. At eval it uses running
    statistics and is causal again, so train and eval behave differently.
    """

    def __init__(self, dim: int, *, eps: float = 1e-5, affine: bool = True, momentum: float = 0.1) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, eps=eps, affine=affine, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.bn(x.reshape(-1, shape[-1])).view(shape)  # (B*T, C) rows = every position of every example


class NoNorm(nn.Module):
    """Identity: the residual stream is left unnormalised."""

    def __init__(self, dim: int) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


NORMS = {"layer": LayerNorm, "rms": RMSNorm, "scale": ScaleNorm, "batch": BatchNorm, "none": NoNorm}
