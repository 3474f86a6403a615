"""Checks every new option's tests make the same way: it trains, its bad input is refused before training, and cached
generation gives the full forward."""

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


def trunk(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """The trunk's final hidden state before the final norm (the last block's output) for `idx`."""
    out = []
    hook = model.h[-1].register_forward_hook(lambda m, a, o: out.append(o))
    model(idx)
    hook.remove()
    return out[0]


def assert_refused(overrides: list[str], message: str) -> None:
    """train.py's checks before training refuse the config of `overrides`, matching `message`."""
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=message):
        check_config(compose(overrides))


def assert_cached_equals_full(model: torch.nn.Module, idx: torch.Tensor) -> None:
    """The logits of `idx` (B, T ≥ 10) read through a KV cache in pieces (5 tokens, 4, then one at a time) equal the
    full forward's."""
    from lmlab.model.attention.cache import KVCache

    model.eval()
    with torch.no_grad():
        whole = model(idx)
        cache = KVCache(len(model.h))
        steps = [model(idx[:, :5], cache=cache), model(idx[:, 5:9], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(9, idx.size(1))]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, rtol=1e-5, atol=1e-5)
