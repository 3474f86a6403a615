"""optim=ademamix against its formulas (lmlab/optim/ademamix.py; Pagliardini et al. 2024, Algorithm 1), number by
number over steps whose gradients change, with the warmup of α and β3 and the decoupled decay; its schedulers'
end points; and as the optim axis builds it from its YAML."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab import compose
from lmlab.optim import OPTIMIZERS, optimizer_spec, param_groups
from lmlab.optim.ademamix import AdEMAMix, warmed
from lmlab.registry import build

GRADS = [[0.5, -1.0], [0.1, -2.0], [-0.3, 0.4], [0.2, 0.2]]


def _by_hand(theta, lr, betas, alpha, warmup, eps, wd):
    b1, b2, b3 = betas
    m1, m2, v = [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]
    for t, g in enumerate(GRADS, start=1):
        if warmup and t < warmup:  # the paper's f_alpha and f_beta3
            a = t * alpha / warmup
            ln1, ln3 = math.log(b1), math.log(b3)
            beta3 = min(math.exp(ln1 * ln3 / ((1 - t / warmup) * ln3 + (t / warmup) * ln1)), b3)
        else:
            a, beta3 = alpha, b3
        for i in range(2):
            m1[i] = b1 * m1[i] + (1 - b1) * g[i]
            m2[i] = beta3 * m2[i] + (1 - beta3) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            step = (m1[i] / (1 - b1 ** t) + a * m2[i]) / (math.sqrt(v[i] / (1 - b2 ** t)) + eps)
            theta[i] = theta[i] * (1 - lr * wd) - lr * step
    return theta


@pytest.mark.parametrize(("warmup", "wd"), [(0, 0.0), (3, 0.1)])
def test_four_steps_follow_the_formulas(warmup: int, wd: float) -> None:
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.float64))
    opt = AdEMAMix([p], lr=0.1, betas=(0.9, 0.99, 0.999), alpha=4.0, warmup_steps=warmup, eps=1e-8,
                   weight_decay=wd)
    for g in GRADS:
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
    expected = _by_hand([1.0, -2.0], 0.1, (0.9, 0.99, 0.999), 4.0, warmup, 1e-8, wd)
    assert p.tolist() == pytest.approx(expected, rel=1e-12)
    # the slow EMA matters: with α = 0 it is Adam (bias-corrected m1 / √v̂), which lands elsewhere
    adam = _by_hand([1.0, -2.0], 0.1, (0.9, 0.99, 0.999), 0.0, 0, 1e-8, wd)
    assert p[0].item() != pytest.approx(adam[0], rel=1e-3)


def test_the_schedulers_run_from_beta1_and_zero_to_beta3_and_alpha() -> None:
    assert warmed(0, 5.0, 0.9, 0.9999, 100) == pytest.approx((0.0, 0.9))  # t = 0: β3_t = β1
    alpha, beta3 = warmed(50, 5.0, 0.9, 0.9999, 100)
    assert alpha == pytest.approx(2.5) and 0.9 < beta3 < 0.9999
    # the slow EMA's time scale −1/ln β3_t grows linearly with t: halfway, the mean of β1's and β3's
    assert -1 / math.log(beta3) == pytest.approx((-1 / math.log(0.9) - 1 / math.log(0.9999)) / 2, rel=1e-9)
    assert warmed(100, 5.0, 0.9, 0.9999, 100) == (5.0, 0.9999) == warmed(7, 5.0, 0.9, 0.9999, 0)


def test_alpha_zero_is_adam_without_the_slow_ema() -> None:
    torch.manual_seed(0)
    a, b = (torch.nn.Parameter(torch.randn(5, dtype=torch.float64)) for _ in range(2))
    b.data.copy_(a.data)
    mix = AdEMAMix([a], lr=0.01, betas=(0.9, 0.999, 0.9999), alpha=0.0)
    adam = torch.optim.Adam([b], lr=0.01, betas=(0.9, 0.999), eps=1e-8)
    for _ in range(5):
        g = torch.randn(5, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        mix.step()
        adam.step()
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_axis_builds_it_from_its_yaml_with_the_decay_on_matrices_only() -> None:
    cfg = compose(["optim=ademamix"])
    assert cfg.optim.name == "ademamix" and list(cfg.optim.betas) == [0.9, 0.999, 0.9999]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    spec = optimizer_spec(dict(cfg.optim))
    opt = build("optim", OPTIMIZERS, spec, param_groups(model, cfg.optim.weight_decay))
    assert isinstance(opt, AdEMAMix) and opt.defaults["alpha"] == 5.0 and opt.defaults["warmup_steps"] == 0
    assert sorted(g["weight_decay"] for g in opt.param_groups) == [0.0, 0.1]
    with pytest.raises(ValueError, match="optim.alpha"):
        build("optim", OPTIMIZERS, {**spec, "alpha": -1.0}, param_groups(model, 0.0))
