"""`head=mtp_logits`: the GPT-2 speedrun's parameter-free multi-token prediction (modded-nanogpt, record 53,
2025-12-22, "Multi-token prediction"): the logits z_i that predict the next token t_{i+1} are scored on the tokens
after it too, with no module added:

    objective = L_next + Σ_{k=2..K} w_k · L_k,      L_k = (1/N) Σ_i [i + k ≤ T] · CE(z_i, t_{i+k})

N the positions the next-token loss counts; a position whose k-th token lies past its sequence adds nothing but
counts, as in the record (its loss is a sum over every position with those entries zeroed). `weights` are w_2 .. w_K
(the record's [0.5, 0.25], with w_1 = 1). `fade=true` is the record's schedule: K equal phases of max_steps, in phase
j < K − 1 the last weight still on falls linearly to 0 ([1, .5, .25 → 0] → [1, .5 → 0] → [1] for K = 3), set from the
step by the training loop (`set_step`, a function of the step alone) into a buffer, so a compiled forward sees no new
constant. `train/mtp_logits_loss` logs Σ w_k·L_k at the step's weights. Training only: validation, eval.py and
generation read the next-token model, as head=next with the same weights.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from lmlab.model.encoder import IGNORE
from lmlab.model.next_token import NextToken
from lmlab.model.side import Term

if TYPE_CHECKING:
    from lmlab.config import GPTConfig

MTP_LOGITS_LOSS = "mtp_logits_loss"  # its side-channel term (lmlab.model.side): train/mtp_logits_loss


def faded(weights: list[float], step: int, max_steps: int) -> list[float]:
    """The record's schedule of w_2 .. w_K at `step` of `max_steps`: K phases; in phase j < K − 1 the weight of index
    K − 2 − j falls from its value to 0, those after it are 0; from phase K − 1 on, all are 0."""
    n = len(weights)
    x = step / max(1, max_steps) * (n + 1)  # in phases
    out = []
    for i, w in enumerate(weights):
        j = n - 1 - i  # the phase in which weight i fades
        out.append(w if x < j else w * max(0.0, 1 - (x - j)) if x < j + 1 else 0.0)
    return out


def shifted(targets: torch.Tensor, k: int) -> torch.Tensor:
    """t_{i+k} for each position i (targets are t_{i+1}): the targets k − 1 further on, IGNORE past the sequence."""
    return F.pad(targets[:, k - 1:], (0, k - 1), value=IGNORE)


class MTPLogits(NextToken):
    """The next token, and in training the tokens after it from the same logits (module docstring)."""

    def __init__(self, cfg: GPTConfig, *, weights: list[float] = (0.5, 0.25), fade: bool = False) -> None:
        super().__init__(cfg)
        if not weights or any(w < 0 for w in weights) or len(weights) >= cfg.max_seq_len:
            raise ValueError(f"head.weights={list(weights)} are w_2 .. w_K, the weights of the tokens 2 .. K ahead: "
                             f"at least one, none negative, fewer than model.max_seq_len={cfg.max_seq_len}")
        self.start = [float(w) for w in weights]
        self.fade = fade
        self.register_buffer("now", torch.tensor(self.start), persistent=False)  # the step's w_2 .. w_K
        self.weights = (1.0,)  # its term (Σ w_k·L_k) enters the objective whole
        self._term: Term | None = None

    @property
    def declared(self) -> dict[str, tuple[str, ...]]:
        return {MTP_LOGITS_LOSS: ("train",)}

    def set_step(self, step: int, max_steps: int) -> None:
        """`fade`: the weights at `step` (the record's phases); constant otherwise."""
        if self.fade:
            self.now.copy_(torch.tensor(faded(self.start, step, max_steps)))

    def loss(self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor, lm_loss: Any,
             z_loss: float = 0.0, parts: bool = False) -> Any:
        """The next-token loss; in training Σ w_k·L_k is recorded for `terms` (the same h)."""
        self._term = None
        if self.training:
            counted = (targets != IGNORE).sum().clamp(min=1)
            total = h.new_zeros((), dtype=torch.float32)
            for k in range(2, len(self.start) + 2):
                later = shifted(targets, k)
                n = (later != IGNORE).sum()
                ce = lm_loss(h, later)  # mean over the n positions with a k-th token (0 / 0 when n = 0: dropped)
                total = total + self.now[k - 2] * torch.where(n > 0, ce, 0.0) * n / counted
            self._term = Term(MTP_LOGITS_LOSS, total, 1.0)
        return lm_loss(h, targets, z_loss=z_loss, parts=parts)

    def terms(self, *args: Any) -> list[Term]:
        term, self._term = self._term, None
        return [] if term is None else [term]
