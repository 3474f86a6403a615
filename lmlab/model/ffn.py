"""Position-wise feed-forward networks.

Contract: `FFN(dim, hidden, *, activation, bias)` maps (..., dim) -> (..., dim); `activation` is the
config of the `activation` group. `hidden_ratio` on each class is the parameter-matching rule that
`GPTConfig` applies once: a GLU has three matrices instead of two, so its hidden size is 2/3 of the
MLP's and the variants compare at (nearly) equal parameter counts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lmlab.model.activation import Activation


class MLP(nn.Module):
    """The original Transformer FFN (Vaswani et al., 2017): W2 act(W1 x + b1) + b2."""

    hidden_ratio = 1.0
    sublayer = "ffn"  # the monitor's name for it (grad/norm/layer_XX/ffn)

    def __init__(self, dim: int, hidden: int, *, activation: Mapping[str, Any], bias: bool = False) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, hidden, bias=bias)
        self.act = Activation(activation)
        self.c_proj = nn.Linear(hidden, dim, bias=bias)
        self.c_proj.is_residual_proj = True  # read by the init schemes (GPT-2's 1/sqrt(2L) scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GLU(nn.Module):
    """Gated linear unit FFN (Dauphin et al., 2017; Shazeer, 2020): Wd[act(Wg x) * (Wu x)].

    The gate uses the `activation` group unless a subclass pins `gate`. Wg and Wu are fused into one
    matrix `c_fc` of shape (2·hidden, dim): one matmul instead of two.
    """

    hidden_ratio = 2 / 3
    sublayer = "ffn"
    gate: str | None = None  # set by SwiGLU / GeGLU / ReGLU: the gate is fixed whatever `activation` says

    def __init__(self, dim: int, hidden: int, *, activation: Mapping[str, Any], bias: bool = False) -> None:
        super().__init__()
        self.c_fc = nn.Linear(dim, 2 * hidden, bias=bias)  # [gate; up]
        self.c_fc.fused = (hidden, hidden)  # fan-based inits treat the two matrices separately
        self.act = Activation({"name": self.gate} if self.gate else activation)
        self.c_proj = nn.Linear(hidden, dim, bias=bias)
        self.c_proj.is_residual_proj = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.c_fc(x).chunk(2, dim=-1)  # (..., hidden) each
        return self.c_proj(self.act(gate) * up)


class SwiGLU(GLU):
    """GLU with a SiLU gate (Shazeer, 2020), as in PaLM and Llama."""

    gate = "silu"


class GeGLU(GLU):
    """GLU with a GELU gate (Shazeer, 2020)."""

    gate = "gelu"


class ReGLU(GLU):
    """GLU with a ReLU gate (Shazeer, 2020)."""

    gate = "relu"


FFNS = {"mlp": MLP, "glu": GLU, "swiglu": SwiGLU, "geglu": GeGLU, "reglu": ReGLU}
