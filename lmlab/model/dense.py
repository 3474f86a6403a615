"""The dense feed-forward networks (the MLP and the GLUs) of the `ffn` axis (lmlab.model.ffn: the contract and the
registry) and `matched_hidden`, which sizes each to the MLP's parameter count. They sit below the routed option
(lmlab.model.moe), whose experts are of these kinds.
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
        self.hidden_scale: nn.Module | None = None  # on c_fc's outputs (norm=ngpt's s_v·√d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        return self.c_proj(self.act(h if self.hidden_scale is None else self.hidden_scale(h)))

    @staticmethod
    def n_params(dim: int, hidden: int, bias: bool) -> int:
        """W1 (hidden × dim), W2 (dim × hidden), and with biases b1 (hidden) and b2 (dim)."""
        return 2 * dim * hidden + bias * (hidden + dim)


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
        self.hidden_scale: nn.Module | None = None  # on c_fc's outputs [gate; up] (norm=ngpt's s_v·√d_model, s_u)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.c_fc(x)
        gate, up = (h if self.hidden_scale is None else self.hidden_scale(h)).chunk(2, dim=-1)  # (..., hidden) each
        return self.c_proj(self.act(gate) * up)

    @staticmethod
    def n_params(dim: int, hidden: int, bias: bool) -> int:
        """Wg, Wu (hidden × dim each), Wd (dim × hidden), and with biases two of size hidden and one of dim."""
        return 3 * dim * hidden + bias * (2 * hidden + dim)


class SwiGLU(GLU):
    """GLU with a SiLU gate (Shazeer, 2020), as in PaLM and Llama."""

    gate = "silu"


class GeGLU(GLU):
    """GLU with a GELU gate (Shazeer, 2020)."""

    gate = "gelu"


class ReGLU(GLU):
    """GLU with a ReLU gate (Shazeer, 2020)."""

    gate = "relu"


DENSE_FFNS = {"mlp": MLP, "glu": GLU, "swiglu": SwiGLU, "geglu": GeGLU, "reglu": ReGLU}


def matched_hidden(ffn: type[nn.Module], dim: int, mlp_hidden: int, bias: bool, multiple_of: int) -> int:
    """The hidden size of `ffn` whose parameter count is within 1% of an MLP's of hidden `mlp_hidden`.

    The exact match h* (n_params is linear in hidden) is rounded to a multiple of `multiple_of` when that stays
    within 1% (hardware-friendly sizes for wide models), else to the largest of multiple_of/2, multiple_of/4, ...
    (halving while it divides) that does, else to the nearest integer. A GLU at d 64 (MLP 256): h* = 170.7, and
    192 (+12.5%), 160, 176, 168 all miss 1%, so 172 = 43·4 (+0.8%); at d 1024, 2752 = 43·64 (+0.8%).
    """
    target = MLP.n_params(dim, mlp_hidden, bias)
    fixed = ffn.n_params(dim, 0, bias)
    exact = (target - fixed) / (ffn.n_params(dim, 1, bias) - fixed)
    q = multiple_of
    while True:
        hidden = max(q, q * round(exact / q))
        if 100 * abs(ffn.n_params(dim, hidden, bias) - target) <= target or q == 1:  # integers: 1% exactly is in
            return hidden
        q = q // 2 if q % 2 == 0 else 1
