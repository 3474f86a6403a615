"""`residual=unet`: long skips across the stack (the GPT-2 speedrun's U-net; Ronneberger et al.'s shape): the output
of layer L − 1 − i is added, times a learned gate g_i (init `gate_init`), to the input of layer i, for each layer i of
the second half (i ≥ ⌈L/2⌉; with L odd the middle layer receives none): the last layer of the first half feeds the
first of the second, the first layer feeds the last."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class UNet(nn.Module):
    def __init__(self, cfg: GPTConfig, *, gate_init: float = 1.0) -> None:
        super().__init__()
        if cfg.n_layer < 2:
            raise ValueError(f"residual=unet skips from the first half of the layers to the second: model.n_layer="
                             f"{cfg.n_layer} has no halves (>= 2 layers)")
        self.n_layer = cfg.n_layer
        self.first_receiver = (cfg.n_layer + 1) // 2
        self.gates = nn.Parameter(torch.full((cfg.n_layer - self.first_receiver,), float(gate_init)))
        self.skips: dict[int, torch.Tensor] = {}

    def source(self, i: int) -> int | None:
        """The layer whose output layer i receives, or None."""
        return self.n_layer - 1 - i if i >= self.first_receiver else None

    def start(self, x0: torch.Tensor, idx: torch.Tensor) -> None:
        self.skips = {}

    def before(self, i: int, x: torch.Tensor) -> torch.Tensor:
        src = self.source(i)
        if src is None:
            return x
        return x + self.gates[i - self.first_receiver].to(x.dtype) * self.skips.pop(src)

    def after(self, i: int, x: torch.Tensor) -> torch.Tensor:
        if i < self.n_layer // 2:
            self.skips[i] = x
        return x


OPTIONS = {"unet": UNet}
