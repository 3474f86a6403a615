"""optim=schedulefree: the evaluation weights x (computed out of place exactly as the package's eval() leaves them),
validation on x, checkpoints holding x with y beside them, and a resume (after a signal at any step, or after a
checkpoint written at validation) that reproduces the uninterrupted run's metrics.csv."""

from __future__ import annotations

import pytest
import torch

from lmlab.optim import OPTIMIZERS


def test_eval_weights_are_evals_bits_and_train_returns() -> None:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5, 3))
    opt = OPTIMIZERS["schedulefree"]([{"params": [p], "weight_decay": 0.1}], lr=0.01)
    assert opt.training
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    y = p.detach().clone()
    x = opt.eval_weights()[p.data_ptr()]
    torch.testing.assert_close(x, y.lerp(opt.state[p]["z"], 1 - 1 / 0.9), rtol=0, atol=0)
    assert not torch.equal(x, y)
    opt.eval()
    assert not opt.training and torch.equal(p.detach(), x)
    assert torch.equal(opt.eval_weights()[p.data_ptr()], x)  # in eval mode: the parameter itself
    opt.train()
    torch.testing.assert_close(p.detach(), y, rtol=1e-6, atol=1e-7)  # back to y (to rounding)


def test_the_schedule_decay_is_replaced_by_its_warmup_only() -> None:
    from lmlab.run.lit import configure_optimization

    p = torch.nn.Linear(3, 3)
    out = configure_optimization(p, {"name": "schedulefree", "lr": 0.1, "weight_decay": 0.0},
                                 {"name": "cosine", "warmup_steps": 4, "min_lr_ratio": 0.1}, max_steps=10)
    sched, opt = out["lr_scheduler"]["scheduler"], out["optimizer"]
    lrs = []
    for _ in range(10):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.025, 0.05, 0.075, 0.1] + [0.1] * 6)  # constant after warmup, no cosine
