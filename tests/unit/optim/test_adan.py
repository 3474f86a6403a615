"""optim=adan against its formulas (lmlab/optim/adan.py), number by number over steps whose gradients change, with the
decoupled decay; and as the optim axis builds it from its YAML."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab import compose
from lmlab.optim import OPTIMIZERS, optimizer_spec, param_groups
from lmlab.optim.adan import Adan
from lmlab.registry import build

GRADS = [[0.5, -1.0], [0.1, -2.0], [-0.3, 0.4]]


def _by_hand(theta: list[float], lr: float, betas: tuple[float, float, float], eps: float, wd: float) -> list[float]:
    b1, b2, b3 = betas
    m, v, n, prev = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], None
    for k, g in enumerate(GRADS, start=1):
        prev = g if prev is None else prev
        for i in range(2):
            d = g[i] - prev[i]
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * d
            n[i] = b3 * n[i] + (1 - b3) * (g[i] + b2 * d) ** 2
            step = (m[i] / (1 - b1 ** k) + b2 * v[i] / (1 - b2 ** k)) / (math.sqrt(n[i] / (1 - b3 ** k)) + eps)
            theta[i] = theta[i] * (1 - lr * wd) - lr * step
        prev = g
    return theta


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_three_steps_follow_the_formulas(wd: float) -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = Adan([p], lr=0.1, betas=(0.9, 0.8, 0.7), eps=1e-8, weight_decay=wd)
    for g in GRADS:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    expected = _by_hand([1.0, -2.0], 0.1, (0.9, 0.8, 0.7), 1e-8, wd)
    assert p.tolist() == pytest.approx(expected, rel=1e-12)
    # the change term matters: without it (β2's moment) the second coordinate would land elsewhere
    assert p[1].item() != pytest.approx(_by_hand([1.0, -2.0], 0.1, (0.9, 0.0, 0.7), 1e-8, wd)[1], rel=1e-3)


def test_the_first_step_is_a_sign_step_of_size_lr() -> None:
    """Δ = 0 at the first step, so m̂ = g and n̂ = g²: the update is g/|g| (up to ε), as Adam's first step."""
    p = torch.nn.Parameter(torch.tensor([3.0, -4.0]))
    p.grad = torch.tensor([0.01, -7.0])
    Adan([p], lr=0.5).step()
    assert p.tolist() == pytest.approx([2.5, -3.5], rel=1e-5)


def test_the_axis_builds_it_from_its_yaml_with_the_decay_on_matrices_only() -> None:
    cfg = compose(["optim=adan"])
    assert cfg.optim.name == "adan" and list(cfg.optim.betas) == [0.98, 0.92, 0.99]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    spec = optimizer_spec(dict(cfg.optim))  # less the loop's keys (OPTIM_LOOP_KEYS)
    opt = build("optim", OPTIMIZERS, spec, param_groups(model, cfg.optim.weight_decay))
    assert isinstance(opt, Adan) and opt.defaults["betas"] == (0.98, 0.92, 0.99)
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.02]
    with pytest.raises(ValueError, match="optim.betas"):
        build("optim", OPTIMIZERS, {**spec, "betas": [0.98, 0.92, 1.5]}, param_groups(model, 0.0))
