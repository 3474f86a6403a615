"""Checks every new option's tests make the same way: it trains, and its bad input is refused before training."""

from __future__ import annotations

import pytest
import torch

from lmlab import compose


def assert_trains(model: torch.nn.Module, idx: torch.Tensor, owned: str, steps: int = 30, drop: float = 1.0) -> None:
    """`steps` AdamW steps on one batch (next-token targets) lower the loss by more than `drop`, and at the first step
    every parameter whose name contains `owned` (the option's own weights) gets a non-zero gradient."""
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = model(idx, targets=idx.roll(-1, 1))
        opt.zero_grad()
        loss.backward()
        if not losses:
            mine = {k: p for k, p in model.named_parameters() if owned in k}
            assert mine, f"no parameter named like {owned!r}"
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in mine.values()), sorted(mine)
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - drop, losses


def assert_refused(overrides: list[str], message: str) -> None:
    """train.py's checks before training refuse the config of `overrides`, matching `message`."""
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=message):
        check_config(compose(overrides))
