"""LAMB's trust ratio and cautious weight decay, each by hand; schedule-free's modes and evaluation weights."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lmlab.optim import OPTIMIZERS


def test_lamb_two_steps_by_hand() -> None:
    """r = m̂/(√v̂ + ε) + wd·θ, θ ← θ − lr·(‖θ‖/‖r‖)·r, with the moments computed number by number."""
    theta, grads = [3.0, -4.0], [[1.0, 2.0], [-0.5, 0.5]]
    lr, b1, b2, eps, wd = 0.1, 0.9, 0.999, 1e-6, 0.01
    p = nn.Parameter(torch.tensor(theta, dtype=torch.float64))
    opt = OPTIMIZERS["lamb"]([{"params": [p], "weight_decay": wd}], lr=lr, betas=(b1, b2), eps=eps)
    m, v = [0.0, 0.0], [0.0, 0.0]
    for t, g in enumerate(grads, start=1):
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
        v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
        r = [mi / (1 - b1 ** t) / (math.sqrt(vi / (1 - b2 ** t)) + eps) + wd * th for mi, vi, th in zip(m, v, theta)]
        ratio = math.hypot(*theta) / math.hypot(*r)
        theta = [th - lr * ratio * ri for th, ri in zip(theta, r)]
        assert p.detach().tolist() == pytest.approx(theta, rel=1e-9)
    assert math.hypot(*theta) == pytest.approx(5.0, rel=0.25)  # each step moves it by about lr·‖θ‖


def test_lamb_trust_ratio_edges() -> None:
    """Ratio 1 where ‖θ‖ = 0 (a zero-initialised bias takes Adam's step) or ‖r‖ = 0; max_trust_norm clamps ‖θ‖."""
    from lmlab.optim.lamb import LAMB

    assert float(LAMB.trust_ratio(torch.zeros(3), torch.ones(3))) == 1.0
    assert float(LAMB.trust_ratio(torch.ones(3), torch.zeros(3))) == 1.0
    assert float(LAMB.trust_ratio(torch.full((4,), 3.0), torch.ones(4))) == pytest.approx(3.0)  # 6 / 2
    assert float(LAMB.trust_ratio(torch.full((4,), 3.0), torch.ones(4), max_trust_norm=4.0)) == pytest.approx(2.0)
    b = nn.Parameter(torch.zeros(3))
    b.grad = torch.tensor([1.0, -2.0, 0.0])
    OPTIMIZERS["lamb"]([{"params": [b], "weight_decay": 0.0}], lr=0.1, eps=1e-12).step()
    torch.testing.assert_close(b.detach(), torch.tensor([-0.1, 0.1, 0.0]))  # −lr·sign(g) at step 1


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_cautious_decay_by_hand(name: str) -> None:
    """θ ← θ − lr·u − lr·wd·θ·1[u·θ > 0]: the plain step's update u (decay off), and the decay only on the entries
    where u and θ agree in sign; with cautious_wd=false every entry decays (torch's decoupled decay)."""
    torch.manual_seed(0)
    theta0, g = torch.randn(6, 4), torch.randn(6, 4)
    lr, wd = 0.05, 0.5

    def run(cautious: bool | None) -> torch.Tensor:
        w = nn.Parameter(theta0.clone())
        kw = {"lr": lr} if name == "adamw" else {"lr": lr, "adam_lr": lr}
        opt = OPTIMIZERS[name]([{"params": [w], "weight_decay": 0.0 if cautious is None else wd}],
                               cautious_wd=bool(cautious), **kw)
        w.grad = g.clone()
        opt.step()
        return w.detach()

    plain = run(None)  # no decay: θ − lr·u
    u = (theta0 - plain) / lr
    agree = (u * theta0 > 0).float()
    assert 0 < agree.mean() < 1  # some entries each way
    torch.testing.assert_close(run(True), theta0 - lr * u - lr * wd * theta0 * agree, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(run(False), theta0 * (1 - lr * wd) - lr * u, rtol=1e-5, atol=1e-6)
