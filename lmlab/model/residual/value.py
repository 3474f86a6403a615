"""`residual=value_residual`: every layer's values mixed with the first layer's (ResFormer: Zhou et al., 2024, "Value
Residual Learning"; the GPT-2 speedrun's value residual): v_l ← (1 − λ_l)·v_l + λ_l·v_1 for layers l ≥ 1, the first
layer's values v_1 of the same tokens (before the KV cache, so the cache holds the mixed values). λ_l = `init` (0.5:
ResFormer's equal mix), learned per layer when `learned` (the speedrun's). Needs attention whose values are computed
per token before they are cached (mha, gqa, mqa, diff); refused for attention=mla (its cache holds the latent) and for
block=gau. A later layer without attention (mixer.pattern: `none`, a recurrent mixer) has no values to mix; the first
layer must have attention (its values are what the others read), else it is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.model.layers import layer_plan
from lmlab.registry import Fraction

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class _First:
    """The first layer's values of this forward's tokens, shared by the layers' mixes (not a module: no weights)."""

    v: torch.Tensor | None = None


class ValueMix(nn.Module):
    """Layer l's mix: the first layer keeps its values (and shares them), the others mix them in."""

    def __init__(self, layer: int, first: _First, init: float, learned: bool) -> None:
        super().__init__()
        self.layer, self.first = layer, first
        lam = torch.tensor(float(init))
        if learned and layer > 0:
            self.lam = nn.Parameter(lam)
        else:
            self.register_buffer("lam", lam, persistent=False)

    def forward(self, v: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        if self.layer == 0:
            self.first.v = v
            return v
        lam = self.lam.to(v.dtype)
        return (1 - lam) * v + lam * self.first.v


class ValueResidual(nn.Module):
    def __init__(self, cfg: GPTConfig, *, init: Fraction = 0.5, learned: bool = True) -> None:
        super().__init__()
        if cfg.block.get("name", "transformer") != "transformer":
            raise ValueError(f"residual=value_residual mixes attention values: it needs block=transformer (got "
                             f"block={cfg.block['name']!r})")
        if cfg.attention.get("name") == "mla":
            raise ValueError("residual=value_residual with attention=mla: MLA caches a latent, not the values it "
                             "would mix; use attention=mha|gqa|mqa|diff")
        if not (first := layer_plan(cfg)[0]).attention:
            raise ValueError(f"residual=value_residual mixes the first layer's attention values into the later "
                             f"layers': layer 0 is {first.mixer!r} (mixer={cfg.mixer.get('name')} mixer.pattern="
                             f"{cfg.mixer.get('pattern')}), without attention; make its first entry attention, or "
                             f"leave residual=value_residual out")
        self.init, self.learned, self.first = init, learned, _First()

    def attach(self, model: nn.Module) -> None:
        for layer, block in zip(model.plan, model.h):
            if layer.attention:  # a layer without attention has no values to mix
                block.attn.value_mixes.append(ValueMix(layer.index, self.first, self.init, self.learned))


OPTIONS = {"value_residual": ValueResidual}
