"""`head=next`: the next token only — the head contract's plain case (lmlab.model.head), and the base of the heads that
add to it (multi-token prediction, the prefix-token loss)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.model.side import Term

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class NextToken(nn.Module):
    """The next token only: no extra modules, no extra losses."""

    depth = 0
    weights: tuple[float, ...] = ()
    declared: dict[str, tuple[str, ...]] = {}
    causal = True
    reserved = 0
    predicts_next = True
    draws = False
    objective = "next_token"  # what its loss is (summary.json's `objective`)

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()

    @classmethod
    def n_params(cls, cfg: GPTConfig, **params) -> int:
        return 0

    def prepare(self, idx: torch.Tensor, targets: torch.Tensor, keys: Sequence[Sequence[int]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return idx, targets

    def logits(self, h: torch.Tensor, idx: torch.Tensor, lm_logits: Callable[[torch.Tensor], torch.Tensor]
               ) -> torch.Tensor:
        return lm_logits(h)

    def loss(self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor, lm_loss: Callable[..., Any],
             z_loss: float = 0.0, parts: bool = False) -> Any:
        return lm_loss(h, targets, z_loss=z_loss, parts=parts)

    def terms(self, *args: Any) -> list[Term]:
        return []
