"""`residual=unet`: long skips across the stack (the GPT-2 speedrun's U-net; Ronneberger et al.'s shape): the output
of layer L − 1 − i is added, times a learned gate g_i, to the input of layer i, for each layer i of the second half
(i ≥ ⌈L/2⌉; with L odd the middle layer receives none): the last layer of the first half feeds the first of the
second, the first layer feeds the last.

`pairs` replaces the mirrored wiring by chosen skips [source, receiver] (source < receiver: layer source's output
into layer receiver's input), e.g. the speedrun's record 45 kept one, [[4, 7]] of 12 layers. `gate=scalar` multiplies
by the raw learned w (init `gate_init`); `gate=sigmoid` by σ(w), in (0, 1) (record 32: w from −1.5, σ ≈ 0.18).
`gate_channels=k` > 0 multiplies that by an input-dependent 2σ(u_r·x0_{:k}), read from the first k channels of the
embedding output x0 (record 55's skip gate, k = 12; u_r from zero: a factor of 1 at init).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from lmlab.registry import NonNegativeInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


def mirrored(n_layer: int) -> dict[int, int]:
    """{receiver: source}: layer L − 1 − i into layer i, for the second half's layers."""
    return {i: n_layer - 1 - i for i in range((n_layer + 1) // 2, n_layer)}


def chosen(n_layer: int, pairs: list) -> dict[int, int]:
    """{receiver: source} from [source, receiver] pairs, checked (layers of the model, source before receiver, one
    skip per receiver)."""
    out: dict[int, int] = {}
    for pair in pairs:
        pair = list(pair)
        if len(pair) != 2 or not all(isinstance(p, int) and not isinstance(p, bool) for p in pair):
            raise ValueError(f"residual.unet.pairs has {pair}: each entry is [source, receiver], two layer numbers")
        src, dst = pair
        if not 0 <= src < dst < n_layer:
            raise ValueError(f"residual.unet.pairs has [{src}, {dst}]: a skip runs from an earlier layer's output to "
                             f"a later layer's input, 0 <= source < receiver <= model.n_layer - 1 = {n_layer - 1}")
        if dst in out:
            raise ValueError(f"residual.unet.pairs gives layer {dst} two skips ({out[dst]} and {src}): one per "
                             f"receiving layer")
        out[dst] = src
    if not out:
        raise ValueError("residual.unet.pairs=[] has no skips: give [source, receiver] pairs, or null for the "
                         "mirrored U-net")
    return out


class UNet(nn.Module):
    def __init__(self, cfg: GPTConfig, *, gate_init: float = 1.0, gate: Literal["scalar", "sigmoid"] = "scalar",
                 pairs: list[list[int]] | None = None, gate_channels: NonNegativeInt = 0) -> None:
        super().__init__()
        if gate_channels > cfg.d_model:
            raise ValueError(f"residual.unet.gate_channels={gate_channels} is more than model.d_model={cfg.d_model}: "
                             f"the gate reads the first k channels of the embedding output")
        if cfg.n_layer < 2:
            raise ValueError(f"residual=unet skips from the first half of the layers to the second: model.n_layer="
                             f"{cfg.n_layer} has no halves (>= 2 layers)")
        self.sources = mirrored(cfg.n_layer) if pairs is None else chosen(cfg.n_layer, pairs)
        self.receivers = sorted(self.sources)
        self.saved = set(self.sources.values())
        self.sigmoid = gate == "sigmoid"
        self.gates = nn.Parameter(torch.full((len(self.receivers),), float(gate_init)))
        # u_r: (receivers, k), a matrix of no Linear (AdamW under optim=muon, as the record's skip gate)
        self.inputs = nn.Parameter(torch.zeros(len(self.receivers), gate_channels)) if gate_channels else None
        self.skips: dict[int, torch.Tensor] = {}
        self.x0: torch.Tensor | None = None

    def source(self, i: int) -> int | None:
        """The layer whose output layer i receives, or None."""
        return self.sources.get(i)

    def gate(self, i: int) -> torch.Tensor:
        """Receiver i's gate: w, or σ(w)."""
        w = self.gates[self.receivers.index(i)]
        return torch.sigmoid(w) if self.sigmoid else w

    def start(self, x0: torch.Tensor, idx: torch.Tensor) -> None:
        self.skips, self.x0 = {}, x0

    def before(self, i: int, x: torch.Tensor) -> torch.Tensor:
        src = self.source(i)
        if src is None:
            return x
        g = self.gate(i).to(x.dtype)
        if self.inputs is not None:  # × 2σ(u_r·x0_{:k}) per token: (B, T, 1)
            u = self.inputs[self.receivers.index(i)].to(x.dtype)
            g = g * 2 * torch.sigmoid(self.x0[..., :u.numel()] @ u).unsqueeze(-1)
        return x + g * self.skips[src]

    def after(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if i in self.saved:
            self.skips[i] = x
        return x


OPTIONS = {"unet": UNet}
