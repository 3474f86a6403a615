"""budget.wall's schedule horizon (lmlab.run.wall.WallHorizon): the steps the remaining seconds buy at the measured
step and validation times, worked out by hand, and what a fit changes in a live loop (the LR schedule's end, the loop's
last step, the module's max_steps, Muon's cool-down) without touching the steps already taken."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.utilities.parsing import AttributeDict

from lmlab.optim import cosine
from lmlab.run import wall


def test_the_horizon_is_the_steps_the_remaining_seconds_buy() -> None:
    # 90 s left at step 10; a step takes 0.1 s and a validation 1 s every 10 steps: 0.2 s a step, less the 2% margin
    assert wall.horizon(10, remaining_s=90.0, step_s=0.1, val_s=1.0, val_every=10) == 10 + int(90 * 0.98 / 0.2)
    assert wall.horizon(10, remaining_s=90.0, step_s=0.1, val_s=None, val_every=10) == 10 + int(90 * 0.98 / 0.1)
    assert wall.horizon(10, remaining_s=90.0, step_s=0.1, val_s=1.0, val_every=None) == 10 + int(90 * 0.98 / 0.1)
    assert wall.horizon(10, remaining_s=0.01, step_s=0.1, val_s=None, val_every=None) == 11  # at least one more
    assert wall.horizon(10, remaining_s=-3.0, step_s=0.1, val_s=None, val_every=None) == 11


class _Muon(torch.optim.SGD):
    """An optimizer with Muon's hook for its momentum cool-down (lmlab.optim.muon)."""

    def set_max_steps(self, max_steps: int) -> None:
        self.max_steps = max_steps


def test_a_fit_moves_the_schedules_end_and_the_loops_last_step() -> None:
    w = torch.nn.Parameter(torch.zeros(2))
    opt = _Muon([w], lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: cosine(s, 600, warmup_steps=5, min_lr_ratio=0.1))
    for _ in range(20):  # 20 steps taken on the configured horizon (trainer.max_steps=600)
        opt.step()
        sched.step()
    module = SimpleNamespace(hparams=AttributeDict(schedule={"name": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1},
                                                   max_steps=600, stages=None))
    loop = SimpleNamespace(max_steps=600)
    trainer = SimpleNamespace(optimizers=[opt], lr_scheduler_configs=[SimpleNamespace(scheduler=sched)],
                              fit_loop=SimpleNamespace(epoch_loop=loop))
    wall.set_horizon(trainer, module, 100)
    assert loop.max_steps == module.hparams.max_steps == opt.max_steps == 100
    assert opt.param_groups[0]["lr"] == pytest.approx(cosine(20, 100, warmup_steps=5, min_lr_ratio=0.1))  # at once
    for _ in range(80):
        opt.step()
        sched.step()
    assert sched.last_epoch == 100 and opt.param_groups[0]["lr"] == pytest.approx(0.1)  # the floor at the horizon
