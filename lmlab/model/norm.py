"""Normalization layers.

Contract: `Norm(dim, *, eps, ...)` maps (..., dim) -> (..., dim), keeping dtype. An option that makes the whole model
around it (`ngpt`, lmlab.model.ngpt) also has `attach(model, **its keys)`, which the GPT calls once built and which
returns its model-wide part (the GPT's `norm_model`), `placements` (those it takes) and `check_run` (the training
loop's settings it refuses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.ngpt import NGPT
from lmlab.registry import Fraction, NonNegativeFloat, PositiveFloat


class LayerNorm(nn.Module):
    """LayerNorm (Ba et al., 2016): (x - mean) / sqrt(var + eps) * w + b over the feature dim."""

    def __init__(self, dim: int, *, eps: NonNegativeFloat = 1e-5, affine: bool = True, bias: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine and bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich, 2019): x / sqrt(mean(x²) + eps) * w. No centring, no bias.

    Training on CPU (eager): `_RMSNormFn` with its own backward. torch 2.13 has no fused CPU kernel, and autograd
    through the decomposed `F.rms_norm` takes 6.2 ms forward + backward at (8, 256, 384) against 3.8 ms (1 thread;
    the forwards are equal). Elsewhere (no grad, CUDA's fused kernel, torch.compile) `F.rms_norm`.
    """

    def __init__(self, dim: int, *, eps: NonNegativeFloat = 1e-6, affine: bool = True) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return _RMSNormFn.apply(x, self.weight, self.eps)
        return F.rms_norm(x, (self.dim,), self.weight, self.eps)


class _RMSNormFn(torch.autograd.Function):
    """y = x̂·w, x̂ = x·r, r = (mean(x²) + eps)^-½ over the last dim, computed in fp32 at least.

    Backward: dx = r·(g·w − x̂·mean(g·w·x̂)), dw = Σ g·x̂ over every position.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True).add_(eps))  # (..., 1)
        xhat = xf * r
        ctx.save_for_backward(xhat, r, weight)
        ctx.x_dtype = x.dtype
        return (xhat * weight if weight is not None else xhat).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        xhat, r, weight = ctx.saved_tensors
        g = g.to(xhat.dtype)
        gw = g * weight if weight is not None else g
        dot = (gw * xhat).mean(-1, keepdim=True)
        dx = torch.addcmul(gw, xhat, dot, value=-1).mul_(r) if ctx.needs_input_grad[0] else None
        dweight = None
        if weight is not None and ctx.needs_input_grad[1]:
            dweight = (g * xhat).reshape(-1, xhat.size(-1)).sum(0).to(weight.dtype)
        return (dx.to(ctx.x_dtype) if dx is not None else None), dweight, None


class ScaleNorm(nn.Module):
    """ScaleNorm (Nguyen & Salazar, 2019): g * x / max(‖x‖, eps), one learned scalar g initialised to sqrt(dim)."""

    def __init__(self, dim: int, *, eps: NonNegativeFloat = 1e-5, affine: bool = True) -> None:
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

    def __init__(self, dim: int, *, eps: NonNegativeFloat = 1e-5, affine: bool = True, momentum: Fraction = 0.1
                 ) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(dim, eps=eps, affine=affine, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        return self.bn(x.reshape(-1, shape[-1])).view(shape)  # (B*T, C) rows = every position of every example


class DyT(nn.Module):
    """Dynamic Tanh (Zhu, Chen, He, LeCun & Liu, 2025, "Transformers without Normalization"): no statistics at all,
    γ ⊙ tanh(α·x) + β per channel, α one learned scalar (`alpha_init`, the paper's α₀ = 0.5; it suggests smaller α₀
    for wider or deeper LLMs), γ ones and β zeros (`affine=false`: tanh(α·x) with α still learned). No eps:
    nothing is divided."""

    def __init__(self, dim: int, *, alpha_init: PositiveFloat = 0.5, affine: bool = True) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.tensor(float(alpha_init)))
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.alpha.to(x.dtype) * x)
        return y if self.weight is None else torch.addcmul(self.bias.to(x.dtype), y, self.weight.to(x.dtype))


class NoNorm(nn.Module):
    """Identity: the residual stream is left unnormalised."""

    def __init__(self, dim: int) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


NORMS = {"layer": LayerNorm, "rms": RMSNorm, "scale": ScaleNorm, "batch": BatchNorm, "dyt": DyT, "none": NoNorm}
NORMS["ngpt"] = NGPT  # the normalized Transformer, a norm that makes the model around it (lmlab.model.ngpt)
