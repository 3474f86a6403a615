"""attention.gate: a sigmoid gate on the attention output before the output projection, from the sublayer's input
(Qiu et al., 2025, "Gated Attention", Qwen3-Next): `elementwise` (one gate per head dimension) or `headwise` (one per
head); y ← y ⊙ σ(x W_g). `gate_channels` k reads only x's first k channels (the GPT-2 speedrun's sparse attention
gate, record 28: 12)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from lmlab.model.attention.parts import Part, Widths
from lmlab.registry import NonNegativeInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


def gate_width(gate: str | None, n_head: int, head_dim: int) -> int:
    """The outputs of an attention gate's projection: one per head dimension (elementwise), one per head, or 0."""
    return {None: 0, "elementwise": n_head * head_dim, "headwise": n_head}[gate]


class Gate(Part):
    rank = 1

    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, gate: Literal["elementwise", "headwise"] | None = None,
                 gate_channels: NonNegativeInt = 0) -> None:
        if gate is None or gate_channels > cfg.d_model:
            raise ValueError(f"attention.gate_channels={gate_channels} is how many of the input's first channels the "
                             f"gate reads: it needs attention.gate (elementwise|headwise; got {gate}) and at most "
                             f"model.d_model={cfg.d_model} channels")
        self.channels = gate_channels or cfg.d_model
        attn.gate = nn.Linear(self.channels, gate_width(gate, attn.n_head, attn.v_dim), bias=cfg.bias)

    @classmethod
    def n_params(cls, cfg: GPTConfig, widths: Widths, **keys: Any) -> int:
        return ((keys["gate_channels"] or cfg.d_model) + cfg.bias) * gate_width(keys["gate"], widths.heads,
                                                                                 widths.v_dim)

    def output(self, attn: nn.Module, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """y (B, nh, T, dv) times σ of the gate's (B, T, nh·dv or nh), per head."""
        B, T, _ = x.shape
        return y * torch.sigmoid(attn.gate(x[..., :self.channels])).view(B, T, y.size(1), -1).transpose(1, 2)


PARTS = {"gate": Gate}
