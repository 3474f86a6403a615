"""A weight EMA (an evaluation readout, not part of the update: the optimizer never reads it). After each optimizer
step t, an fp32 copy of every parameter moves toward the weights:

    ema_t = d·ema_{t−1} + (1 − d)·θ_t,   ema_0 = θ_0   (so ema_k = d^k·θ_0 + Σ_{t≤k} (1 − d)·d^(k−t)·θ_t)

with d = `optim.ema` (0: off, no EMA is kept). `optim.ema_start` = S holds ema = θ through step S and averages from
there, so a short run's average doesn't carry its initialisation. Buffers are not averaged: the EMA's model is the
averaged parameters with the live buffers (a norm's running statistics, an MoE's balancing bias, as of the step).

LitGPT (lmlab.run.lit) updates it after every optimizer step, validates both the live weights (val/loss) and the EMA
(val/ema_loss, through `applied`, which puts the live weights back bit for bit), and writes it into each checkpoint
beside the live weights (`lmlab.ema_weights`, fp32, by parameter name) so that a resume continues the same average;
eval.py reads it with `weights=ema`.

Refused (lmlab.optim.validate_optim): optim=schedulefree, whose evaluation weights x are already an average of its
iterates (an option's `averages` reason), and trainer=fsdp2, whose checkpoints write the weights sharded through DCP
while the `lmlab` record is one file of whole tensors. DDP needs nothing: every rank holds the same weights and
averages them identically.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import nn


class WeightEMA:
    """The average of `model`'s parameters (by name, tied ones once), kept in fp32 on their device."""

    def __init__(self, model: nn.Module, decay: float, start: int = 0) -> None:
        if not 0 <= decay < 1:
            raise ValueError(f"optim.ema={decay!r} must be a float in [0, 1)")
        self.decay, self.start = float(decay), int(start)
        with torch.no_grad():
            self.weights = {n: p.detach().float().clone() for n, p in model.named_parameters()}

    def _pairs(self, model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        params = dict(model.named_parameters())
        names = list(self.weights)
        return [self.weights[n] for n in names], [params[n].detach() for n in names]

    @torch.no_grad()
    def update(self, model: nn.Module, step: int) -> None:
        """After the optimizer step that made `step` steps done (1 after the first): average, or copy through
        `start`."""
        ema, params = self._pairs(model)
        params = [p if p.dtype == torch.float32 else p.float() for p in params]
        if step <= self.start:
            torch._foreach_copy_(ema, params)
        else:  # ema + (1 − d)·(θ − ema) = d·ema + (1 − d)·θ
            torch._foreach_lerp_(ema, params, 1.0 - self.decay)

    @contextmanager
    def applied(self, model: nn.Module) -> Iterator[None]:
        """`model` with the EMA as its parameters (cast to their dtype) inside the block, its own weights back after.
        In place (the same tensors: a compiled forward keeps its graph); holds one copy of the weights meanwhile."""
        ema, params = self._pairs(model)
        with torch.no_grad():
            live = [p.clone() for p in params]
            torch._foreach_copy_(params, ema)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(params, live)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The average by parameter name, on the CPU: the checkpoint's `lmlab.ema_weights`."""
        return {n: v.detach().cpu().clone() for n, v in self.weights.items()}

    @torch.no_grad()
    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """A checkpoint's average, onto this one's devices; refused naming the first parameter that differs."""
        for n in sorted(set(self.weights) ^ set(state)):
            where = "the checkpoint's EMA lacks" if n in self.weights else "the model has no"
            raise ValueError(f"optim.ema: {where} parameter {n!r}")
        for n, v in state.items():
            if v.shape != self.weights[n].shape:
                raise ValueError(f"optim.ema: parameter {n!r} is {tuple(v.shape)} in the checkpoint's EMA, "
                                 f"{tuple(self.weights[n].shape)} in the model")
            self.weights[n].copy_(v)


def load_ema(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> nn.Module:
    """`model` (its live weights loaded) with a checkpoint's `lmlab.ema_weights` as its parameters (tied ones
    follow): the model eval.py's `weights=ema` evaluates."""
    ema = WeightEMA(model, decay=0.0)
    ema.load_state_dict(weights)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(ema.weights[n])
    return model
