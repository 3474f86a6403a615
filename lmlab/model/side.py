"""The model's side channel: what a forward computes besides the next token's cross-entropy, as typed terms.

A term is a figure with a name (`metric`, logged as `<split>/<metric>`), its value in this forward, and its weight in
the training objective (0: a figure only). Its sources are the model's own parts: an MoE sublayer records its
balancing losses (`moe_balance_loss`, `router_z_loss`: summed over the layers), the `head` axis its extra depths'
losses (`mtp_loss_<k>`, in validation too), the loss function PaLM's z-loss (`z_loss`, which the loss already adds:
`in_loss`). The GPT collects them in one list per forward (`GPT.terms`): the objective adds Σ weight·value of the
terms not already in the loss; the LightningModule logs `GPT.figures(split)`; the summary records what a run has
(`GPT.side()`), which is what the comparison reads, never an option's name. A new auxiliary loss is a term its module
records; no reader changes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

SPLITS = ("train", "val")


class Term(NamedTuple):
    metric: str  # logged as <split>/<metric> (lmlab.names' names)
    value: torch.Tensor  # a scalar, with its graph (the objective's part is weight · value)
    weight: float  # its coefficient in the training objective (0: logged only)
    splits: tuple[str, ...] = ("train",)  # where it is logged
    in_loss: bool = False  # the loss function already added weight · value (z_loss)


def objective_part(terms: list[Term]) -> torch.Tensor | None:
    """Σ weight·value over the terms the objective still lacks (None: none), each term as its own summand."""
    parts = [t.weight * t.value for t in terms if t.weight and not t.in_loss]
    return torch.stack(parts).sum() if parts else None


def figures(terms: list[Term], split: str) -> dict[str, torch.Tensor]:
    """Each metric logged in `split`, its value summed over the terms that carry it (an MoE's layers), detached."""
    out: dict[str, torch.Tensor] = {}
    for t in terms:
        if split in t.splits:
            value = t.value.detach()
            out[t.metric] = out[t.metric] + value if t.metric in out else value
    return out
