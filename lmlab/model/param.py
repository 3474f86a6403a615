"""The parametrisation axis (`param`): how the init scales, the learning rates, the attention scale and the output
follow the width.

Contract: `Param(cfg, *, <own params>)` built by the GPT from its (resolved) config, with
- `attn_scale_mult`: multiplies every token-mixing sublayer's logit scale 1/√head_dim (`scale_attention(model)`);
- `output_mult`: multiplies the final hidden state before the LM head (the logits' multiplier);
- `rescale_init(model)`: run after the init scheme;
- `per_role` and `lr_mult(role)`: the learning rate of each optimizer group role (lmlab.optim.param_groups: `hidden`,
  `readout`, `rest`) relative to optim.lr; `per_role` false keeps today's two groups.

`sp` (standard parametrisation) changes nothing: the model, its groups and its numbers are those of every earlier run.
`mup` is the maximal update parametrisation (Yang & Hu 2021; Yang et al. 2022, "Tensor Programs V", Table 3 in the
multiplier form the `mup` package uses), for Adam-like optimizers, relative to a base model of width `base_width`
(d_model) with the same depth and heads. With m = d_model / base_width:

| tensors                                   | init std          | Adam lr | multiplier          |
|-------------------------------------------|-------------------|---------|---------------------|
| embeddings, position tables (input)       | init's            | lr      | 1                   |
| hidden matrices (Linear inside the blocks)| init's · m^(-1/2) | lr / m  | 1                   |
| LM head (readout; tied: the embedding's)  | init's            | lr      | output_mult / m     |
| norm gains, biases                        | init's            | lr      | 1                   |
| attention logits                          |                   |         | 1/√d → √d_base / d  |

The untied head keeps the init's std at every width, as the `mup` package's MuReadout does (its default init, var
1/fan_in, times √m when `set_base_shapes` rescales it: constant in the width); only the multiplier 1/m shrinks the
logits. (lmlab shrank it by m^(-1/2) too before; a tied head is the embedding, unchanged.)

With optim=muon (`mup` on the option, its own per-role rule: `lmlab.optim.muon_mup_lr_mult`) the hidden matrices'
learning rate is what the spectral condition asks of an orthogonalised update (Yang, Simon & Bernstein 2023:
‖ΔW‖₂ ∝ √(fan_out/fan_in), constant across widths here): Muon's step has spectral norm lr·s(m, n), so with
`adjust_lr_fn=original` (s = √max(1, fan_out/fan_in), width-free) the hidden lr is not scaled at all, and with
`match_rms_adamw` (s = 0.2·√max(fan_out, fan_in), ∝ √width) it is lr·m^(-1/2) — not Adam's lr/m on top of Muon's own
scale (the double scaling Megatron fixed). The readout and the rest are AdamW's groups and take µP's Adam rules.

At m = 1 (d_model = base_width) every number is SP's: tune lr on the base model, then widen. The head dim grows with
the width (n_head fixed), so the attention's 1/d is √(d_base)/d = (1/√d)·m^(-1/2) per head of size d. µP is defined
here for `init=gpt2` (its N(0, std) is the base width's) and `block=transformer`; the others are refused naming the key:
xavier/small/deepnet already scale their std with the width their own way, and GAU's shared Z has a fixed key size s
at every width (a finite fan-out inside the block, which µP scales as a readout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from lmlab.model.capabilities import ScaledLogits, marks
from lmlab.registry import PositiveFloat, PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class SP:
    """Standard parametrisation: the init scheme's scales, one learning rate, 1/√d, no output multiplier."""

    per_role = False
    attn_scale_mult = 1.0
    output_mult = 1.0

    def __init__(self, cfg: GPTConfig) -> None:
        self.cfg = cfg

    def lr_mult(self, role: str) -> float:
        return 1.0

    def rescale_init(self, model: nn.Module) -> None:
        pass

    def scale_attention(self, model: nn.Module) -> None:
        if self.attn_scale_mult != 1.0:
            for module in model.modules():
                if isinstance(module, ScaledLogits):
                    module.scale *= self.attn_scale_mult


class MuP(SP):
    """µP relative to a base width (see the module's table)."""

    per_role = True

    def __init__(self, cfg: GPTConfig, *, base_width: PositiveInt = 128, output_mult: PositiveFloat = 1.0) -> None:
        super().__init__(cfg)
        block, init = cfg.block.get("name"), cfg.init.get("name")
        if block != "transformer":
            raise ValueError(f"param=mup with block={block!r}: lmlab defines µP for block=transformer (GAU's shared Z "
                             f"keeps its key size s at every width: a finite fan-out that µP scales as a readout); "
                             f"use param=sp")
        if init != "gpt2":
            raise ValueError(f"param=mup with init={init!r}: µP scales init=gpt2's N(0, std) (the base width's) by "
                             f"sqrt(base_width/d_model); xavier, small and deepnet scale with the width their own way. "
                             f"Use init=gpt2")
        if base_width % cfg.n_head:
            raise ValueError(f"param.base_width={base_width} must be divisible by model.n_head={cfg.n_head} (the base "
                             f"model has the same heads, of size base_width / n_head)")
        self.width_mult = cfg.d_model / base_width
        self.attn_scale_mult = self.width_mult ** -0.5  # 1/√d · √(d_base/d) = √d_base / d
        self.output_mult = output_mult / self.width_mult

    def lr_mult(self, role: str) -> float:
        return 1 / self.width_mult if role == "hidden" else 1.0

    def rescale_init(self, model: nn.Module) -> None:
        """Every hidden Linear weight to var ∝ 1/fan_in: std · m^(-1/2); embeddings (a tied head is one) and an
        untied head (`is_readout`: the mup package's MuReadout init, constant in the width) keep the init's std."""
        tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
        seen = set()
        for m in model.modules():
            if marks(m).is_readout:
                continue
            if isinstance(m, nn.Linear) and id(m.weight) not in tables | seen:
                seen.add(id(m.weight))
                m.weight.data.mul_(self.width_mult ** -0.5)


PARAMS = {"sp": SP, "mup": MuP}
