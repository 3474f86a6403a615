"""budget.wall's schedule horizon: the decay fitted to a wall-clock budget, whose steps are unknown until the run has
timed a few of its own.

Lightning's `max_time` (lmlab.run.budget.apply) stops the run at the budget. Without more, the schedule would decay
over `trainer.max_steps`, which has no relation to the seconds: a run stopped by the clock mid-cosine, or one that
decays early and idles at the floor. `WallHorizon` measures the run as it trains and sets the horizon every
schedule reads — the LR schedule's end, the loop's last step, LitGPT's max_steps (attention windows and head fades
that move with the step), Muon's momentum cool-down — to the step the budget reaches:

    horizon = step + ⌊(remaining seconds × (1 − MARGIN)) / (t_step + t_val / val_every)⌋

t_step: the mean seconds of a training step over the last WINDOW of the horizon (the attempt's first step, with
compile and warm-up, is never timed), t_val: the mean seconds of a validation to the next training step (its checkpoint
writes included), val_every: trainer.val_check_interval. It is fitted first after PROBE_STEPS timed steps, then again
every 1/REFITS of the horizon and after each validation, to the end: a drifting step time is followed, and the last fit
falls in the run's last 1/REFITS, so the run ends short of its budget by little more than the MARGIN. A refit
moves the LR schedule's end: on a machine whose speed drifts the LR follows it in small steps (a few % of its peak on
a shared CPU; none on a steady GPU), and reaches its floor at the budget. The MARGIN leaves the fitted end just
before `max_time`, which stays the hard stop: a run that slows down after its last fit is stopped by the clock, a
little above its floor. The fits happen at the same steps on every rank, and every rank takes rank 0's horizon.
`trainer.max_steps` only sets the horizon of the probe steps (and never ends the run before the first fit); the fitted
one replaces it, larger or smaller. A resumed run (Lightning's Timer resumes its clock) fits again from its own
remaining seconds.

Not fitted: under data.batch_schedule / seq_schedule (their stages are placed over trainer.max_steps before the data is
built; the run keeps that horizon) and `${lmlab.step_at:...}` values of a config (resolved when it is composed).
"""

from __future__ import annotations

import math
import time
from typing import Any

from lightning.pytorch.callbacks import Callback, Timer
from lightning.pytorch.trainer.states import TrainerFn
from omegaconf import DictConfig

from lmlab.env import is_rank_zero
from lmlab.optim.capabilities import FollowsHorizon

PROBE_STEPS = 10  # timed steps before the first fit
REFITS = 50  # fitted again every 1/REFITS of the horizon (and after each validation)
WINDOW = 0.1  # the step time is the mean over the last WINDOW of the horizon (at least PROBE_STEPS steps)
MARGIN = 0.02  # of the remaining seconds, left unspent before max_time


def horizon(step: int, *, remaining_s: float, step_s: float, val_s: float | None, val_every: float | None,
            margin: float = MARGIN) -> int:
    """The last step the remaining seconds reach from `step` (the module docstring's rule); at least one more step."""
    per_step = step_s + (val_s / val_every if val_s and val_every else 0.0)
    return step + max(1, math.floor(max(0.0, remaining_s) * (1 - margin) / per_step))


def set_horizon(trainer: Any, module: Any, steps: int) -> None:
    """Make `steps` the run's horizon in the live loop: the loop's last step, LitGPT's max_steps, the LR schedule's end
    (the LambdaLR's function rebuilt as lmlab.run.lit.configure_optimization builds it, the current step's LR set at
    once) and Muon's cool-down. The steps already taken are not replayed."""
    from lmlab.run.lit import lr_lambda

    module.hparams.max_steps = steps
    trainer.fit_loop.epoch_loop.max_steps = steps
    for config in trainer.lr_scheduler_configs:
        sched = config.scheduler
        lr = lr_lambda(sched.optimizer, dict(module.hparams.schedule), steps, module.hparams.get("stages"))
        sched.lr_lambdas = [lr] * len(sched.optimizer.param_groups)
        for group, base in zip(sched.optimizer.param_groups, sched.base_lrs):
            group["lr"] = base * lr(sched.last_epoch)
    for opt in trainer.optimizers:
        if isinstance(opt, FollowsHorizon):  # Muon's momentum cool-down
            opt.set_max_steps(steps)


class WallHorizon(Callback):
    """Fits the schedule's horizon to budget.wall as the run trains (module docstring). `record()`: what it fitted
    and the seconds the trainer's clock ran, for the run's ledger row."""

    def __init__(self, probe_steps: int = PROBE_STEPS) -> None:
        self.probe_steps = probe_steps
        self.steps: int | None = None  # the fitted horizon
        self.step_s: float | None = None
        self.trained_s: float | None = None
        self._timer: Timer | None = None

    def record(self) -> dict[str, Any]:
        return {"horizon": self.steps, "trained_s": self.trained_s, "step_s": self.step_s}

    def on_train_start(self, trainer, pl_module) -> None:
        self._timer = next((c for c in trainer.callbacks if isinstance(c, Timer)
                            and c.time_remaining() is not None), None)
        # (time, step, validation seconds so far) at the attempt's first step's end and at each fit: the step time
        # is read between two of them
        self._marks: list[tuple[float, int, float]] = []
        self._val_s: list[float] = []  # each validation's seconds, to the next training step (its checkpoint too)
        self._val_started: float | None = None
        self._val_done = False
        if self._timer is not None:  # the loop reaches the first fit whatever trainer.max_steps says
            loop = trainer.fit_loop.epoch_loop
            loop.max_steps = max(loop.max_steps, trainer.global_step + self.probe_steps + 1)

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            self._val_started = time.monotonic()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self._val_started is not None:  # a validation and what followed it (ModelCheckpoint's writes) are over
            self._val_s.append(time.monotonic() - self._val_started)
            self._val_started, self._val_done = None, True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if self._timer is None or (self._marks and step == self._marks[-1][1]):  # (a micro-batch of an accumulation)
            return
        if not self._marks:  # the attempt's first step (compile, warm-up) is not timed
            self._marks.append((time.monotonic(), step, sum(self._val_s)))
            return
        since = step - self._marks[-1][1]
        if self.steps is None:
            due = since >= self.probe_steps
        else:  # the same steps and validations on every rank: every rank fits at the same steps
            due = self._val_done or since >= max(1, self.steps // REFITS)
        if due:
            self._fit(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        if self._timer is not None:
            self.trained_s = self._timer.time_elapsed("train")

    def _fit(self, trainer, pl_module) -> None:
        now, step, val_total = time.monotonic(), trainer.global_step, sum(self._val_s)
        window = max(self.probe_steps, int(WINDOW * (self.steps or 0)))
        began, first, val_before = next((m for m in reversed(self._marks) if step - m[1] >= window), self._marks[0])
        step_s = max(1e-9, now - began - (val_total - val_before)) / (step - first)
        every = trainer.val_check_batch  # in batches: in optimizer steps below
        every = every / max(1, trainer.accumulate_grad_batches) if isinstance(every, int | float) and math.isfinite(
            every) else None
        val_s = val_total / len(self._val_s) if self._val_s else None
        steps = horizon(step, remaining_s=self._timer.time_remaining(), step_s=step_s, val_s=val_s, val_every=every)
        steps = int(trainer.strategy.broadcast(steps, src=0))  # every rank ends at rank 0's horizon
        if self.steps is None and is_rank_zero():
            print(f"budget.wall={self._timer.time_remaining() + self._timer.time_elapsed():g}s: "
                  f"{step_s * 1e3:.1f} ms a step -> the schedule's horizon is step {steps} (was "
                  f"{pl_module.hparams.max_steps}; fitted again as the run goes)", flush=True)
        self._marks.append((now, step, val_total))
        self._val_done = False
        self.steps, self.step_s = steps, step_s
        set_horizon(trainer, pl_module, steps)


def wall_horizon(cfg: DictConfig) -> WallHorizon | None:
    """The callback for a run of `cfg` (a checked config): None without budget.wall, and under a batch or length
    schedule (module docstring)."""
    from lmlab.run import budget

    chosen = budget.chosen(cfg)
    if chosen is None or chosen[0] != "wall" or budget.stages_of(cfg) is not None:
        return None
    return WallHorizon()
