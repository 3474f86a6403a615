"""Pointwise activations.

Contract: `f(x, *, <its own parameters>) -> Tensor`. `Activation(spec)` binds the parameters from the
config (e.g. `{"name": "squareplus", "b": 4.0}`) into a module the FFNs call.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.registry import NonNegativeFloat, option_params


def relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU (Hendrycks & Gimpel, 2016), exact erf form: x Φ(x)."""
    return F.gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation (GPT-2's `gelu_new`), through the fused op rather than the Python formula."""
    return F.gelu(x, approximate="tanh")


def silu(x: torch.Tensor) -> torch.Tensor:
    """SiLU / Swish-1 (Ramachandran et al., 2017): x σ(x)."""
    return F.silu(x)


def squareplus(x: torch.Tensor, *, b: NonNegativeFloat = 4.0) -> torch.Tensor:
    """Squareplus (Barron, 2021): (x + sqrt(x² + b)) / 2, a smooth ReLU with no exp; b → 0 gives ReLU."""
    return 0.5 * (x + torch.sqrt(x * x + b))


def relu2(x: torch.Tensor) -> torch.Tensor:
    """Squared ReLU (So et al., 2021, Primer): relu(x)²."""
    return torch.square(F.relu(x))


def leaky_relu(x: torch.Tensor, *, negative_slope: float = 0.01) -> torch.Tensor:
    return F.leaky_relu(x, negative_slope)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(x)


def tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x)


class Activation(nn.Module):
    """An activation with its config parameters bound, usable as a module."""

    def __init__(self, spec: Mapping[str, Any]) -> None:
        super().__init__()
        self.name, self.params = option_params("activation", ACTIVATIONS, spec)
        self.fn = ACTIVATIONS[self.name]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fn(x, **self.params)

    def extra_repr(self) -> str:
        return ", ".join([self.name] + [f"{k}={v}" for k, v in self.params.items()])


ACTIVATIONS = {
    "relu": relu,
    "gelu": gelu,
    "gelu_tanh": gelu_tanh,
    "silu": silu,
    "squareplus": squareplus,
    "relu2": relu2,
    "leaky_relu": leaky_relu,
    "sigmoid": sigmoid,
    "tanh": tanh,
}
