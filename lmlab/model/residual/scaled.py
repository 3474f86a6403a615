"""`residual=scaled`: learned scalars on the stream and on each sublayer's branch.

x ← λ_l·x at the input of layer l when `stream` (the GPT-2 speedrun's `resid_lambdas`, init `stream_init`: 1, or
the record 45's 1.1, which weighs the early layers' outputs up by 1.1^(L − l) at step 0), and each sublayer's
branch F scaled by a learned α (x + α·F(N(x)) under pre-norm): one per sublayer (`per_channel=false`: ReZero,
Bachlechner et al., 2020, with `branch_init=0` — the model is exactly the identity at step 0 — or a scalar at 1) or one
per channel
(`per_channel=true`: LayerScale, Touvron et al., 2021, `branch_init` ≈ 0.1). Under the placements that normalise the
sum (post, deepnorm) α scales F(x) inside the norm, N(x + α·F(x)); under the others it scales the branch after any
norm on it (double: x + α·N(F(N(x)))), where a norm would undo it.

`unscaled_mixer` lists layers whose token-mixing branch (attention, or the layer's recurrent mixer) takes no α, its
FFN keeping its own: the GPT-2 speedrun's record 74 (2026-02-16_FlattenForward) removed the post-attention lambdas
of its single-lane layers 0-5, `lane0 = λ·lane0 + attn_out + x0_inject`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.model.mixer import NONE
from lmlab.registry import NonNegativeFloat, NonNegativeInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class BranchScale(nn.Module):
    """α_j for each sublayer j of one block: (d_model,) per channel or a scalar; the sublayers in `fixed` (1-based)
    have none (their branch passes as it is)."""

    def __init__(self, n_sublayers: int, d_model: int, init: float, per_channel: bool, fixed: tuple[int, ...] = ()
                 ) -> None:
        super().__init__()
        scaled = [j for j in range(1, n_sublayers + 1) if j not in fixed]
        self.rows = {j: row for row, j in enumerate(scaled)}  # sublayer j -> its row of alpha
        shape = (len(scaled), d_model) if per_channel else (len(scaled), 1)
        self.alpha = nn.Parameter(torch.full(shape, float(init)))

    def forward(self, j: int, y: torch.Tensor) -> torch.Tensor:
        row = self.rows.get(j)
        return y if row is None else y * self.alpha[row].to(y.dtype)


class Scaled(nn.Module):
    def __init__(self, cfg: GPTConfig, *, branch_init: NonNegativeFloat = 1.0, per_channel: bool = False,
                 stream: bool = False, stream_init: float = 1.0, unscaled_mixer: list[NonNegativeInt] | None = None
                 ) -> None:
        super().__init__()
        self.branch_init, self.per_channel, self.d_model = branch_init, per_channel, cfg.d_model
        if stream_init != 1.0 and not stream:
            raise ValueError(f"residual.scaled.stream_init={stream_init} starts the stream scalars λ_l, which "
                             f"residual.scaled.stream=false leaves out: set residual.scaled.stream=true")
        self.stream = nn.Parameter(torch.full((cfg.n_layer,), float(stream_init))) if stream else None
        # unscaled_mixer: the layer plan's `unscaled_mixer` (lmlab.model.layers, checked there), read by attach

    @staticmethod
    def unscaled_layers(cfg: GPTConfig, unscaled_mixer: list[int] | None, mixers: Sequence[str]) -> list[int]:
        """`unscaled_mixer`'s layers, checked: layers of the model, each with a token mixer (`mixers`, the layer
        plan's: lmlab.model.layers)."""
        unscaled = sorted(set(unscaled_mixer or ()))
        if bad := [i for i in unscaled if i >= cfg.n_layer]:
            raise ValueError(f"residual.scaled.unscaled_mixer names layers {bad}, past model.n_layer={cfg.n_layer} "
                             f"(layers 0..{cfg.n_layer - 1})")
        for i in unscaled:
            if mixers[i] == NONE:
                raise ValueError(f"residual.scaled.unscaled_mixer names layer {i}, which has no token mixer "
                                 f"(mixer.pattern gives it none): drop it from the list")
        return unscaled

    def attach(self, model: nn.Module) -> None:
        for i, block in enumerate(model.h):
            names, unscaled = block.sublayer_names, model.plan[i].unscaled_mixer
            fixed = tuple(j for j, name in enumerate(names, 1) if name in ("attn", "mix")) if unscaled else ()
            if unscaled and not fixed:
                raise ValueError(f"residual.scaled.unscaled_mixer names layer {i}, which has no token mixer "
                                 f"(mixer.pattern gives it none): drop it from the list")
            if len(fixed) < len(names):  # a layer whose only sublayer is unscaled keeps no scalars
                block.add_transform("branch_scale", BranchScale(len(names), self.d_model, self.branch_init,
                                                                self.per_channel, fixed))

    def before(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x if self.stream is None else self.stream[i].to(x.dtype) * x


OPTIONS = {"scaled": Scaled}
