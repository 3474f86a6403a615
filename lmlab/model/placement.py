"""Where the norms sit in a block (the residual wiring).

Contract: a `Block(cfg, layer_idx)` subclass with its own `forward(x, pos, cache=None)` (`cache`: the layer's KV
cache when generating, handed to attention). Each placement says on itself
whether the model needs a final norm before the LM head (`final_norm`) and what gain the DeepNet init
applies to its value/output/FFN weights (`init_gain`). N = norm, F = attention or FFN sublayer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.model.attention import ATTENTIONS
from lmlab.model.ffn import FFNS
from lmlab.model.norm import NORMS
from lmlab.registry import build

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.cache import LayerCache
    from lmlab.model.position import Position


class Block(nn.Module):
    final_norm = True  # the residual stream is unnormalised at the top: norm it before the head
    post_norms = False  # a second norm on each sublayer's output (double placement)

    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.ln_1 = build("norm", NORMS, cfg.norm, cfg.d_model)
        self.attn = build("attention", ATTENTIONS, cfg.attention, cfg)
        self.ln_2 = build("norm", NORMS, cfg.norm, cfg.d_model)
        self.mlp = build("ffn", FFNS, cfg.ffn_spec, cfg.d_model, cfg.ffn_hidden, activation=cfg.activation,
                         bias=cfg.bias)
        if self.post_norms:
            self.ln_1_post = build("norm", NORMS, cfg.norm, cfg.d_model)
            self.ln_2_post = build("norm", NORMS, cfg.norm, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    @staticmethod
    def init_gain(n_layer: int) -> float:
        return 1.0


class PreNorm(Block):
    """Pre-LN (Xiong et al., 2020; GPT-2): x + F(N(x)). Gradients reach every layer through the identity path."""

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln_1(x), pos, cache))
        return x + self.drop(self.mlp(self.ln_2(x)))


class PostNorm(Block):
    """Post-LN (Vaswani et al., 2017): N(x + F(x)). Large last-layer gradients at init; needs warmup."""

    final_norm = False

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None) -> torch.Tensor:
        x = self.ln_1(x + self.drop(self.attn(x, pos, cache)))
        return self.ln_2(x + self.drop(self.mlp(x)))


class DoubleNorm(Block):
    """Sandwich / double norm (Ding et al., 2021, CogView; Gemma 2): x + N(F(N(x)))."""

    post_norms = True

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.drop(self.ln_1_post(self.attn(self.ln_1(x), pos, cache)))
        return x + self.drop(self.ln_2_post(self.mlp(self.ln_2(x))))


class PostNormNonResidual(Block):
    """Post-norm on the branch only: x + N(F(x)) (the 'non-residual post-norm' of the source notes; Swin v2's
    res-post-norm). The identity path stays unnormalised, so the stream grows and a final norm is needed."""

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.drop(self.ln_1(self.attn(x, pos, cache)))
        return x + self.drop(self.ln_2(self.mlp(x)))


class DeepNorm(Block):
    """DeepNorm (Wang et al., 2022, DeepNet): N(α·x + F(x)), with α = (2L)^(1/4) and the value/output/FFN
    weights initialised with gain β = (8L)^(-1/4) — the decoder-only constants (L = number of layers)."""

    final_norm = False

    def __init__(self, cfg: GPTConfig, layer_idx: int) -> None:
        super().__init__(cfg, layer_idx)
        self.alpha = (2 * cfg.n_layer) ** 0.25

    @staticmethod
    def init_gain(n_layer: int) -> float:
        return (8 * n_layer) ** -0.25

    def forward(self, x: torch.Tensor, pos: Position, cache: LayerCache | None = None) -> torch.Tensor:
        x = self.ln_1(self.alpha * x + self.drop(self.attn(x, pos, cache)))
        return self.ln_2(self.alpha * x + self.drop(self.mlp(x)))


PLACEMENTS = {"pre": PreNorm, "post": PostNorm, "double": DoubleNorm, "post_nonres": PostNormNonResidual,
              "deepnorm": DeepNorm}
