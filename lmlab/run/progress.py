"""Training progress: Lightning's bar on a terminal, plain lines anywhere else (nohup, SLURM, a log file).

train.py trains for `trainer.max_steps` on an endless loader, so Lightning's `max_epochs` is -1 and its Rich bar
read "Epoch 0/-2". This bar says "Epoch 0" there and keeps everything else (the step count, speed, metrics).
Off a terminal a bar redraws one line in place, which a log file keeps as one final frame (7.5 minutes of training
printed nothing else): `PlainProgress` prints a line every few steps and at each validation instead.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE

from lmlab import names


class StepsRichProgressBar(RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:  # an epoch budget: "Epoch e/E"
            return super()._get_train_description(current_epoch)
        return f"Epoch {current_epoch}".ljust(len(self.validation_description))  # padded as Lightning pads


class PlainProgress(ProgressBar):
    """One line every `every` steps (None: about 20 lines a run) and one at each validation, to stdout:
    `step 120/600  loss 2.3140  12,345 tok/s  eta 1m20s` and `val at step 200: loss 2.1000`.

    The loss and speed are measured on the steps Lightning logs (every trainer.log_every_n_steps), which need not be
    the steps a line is printed at: a line shows them only when they were logged since the line before, with the
    step they are of when it is not the line's (`loss 2.3140 @100`); in between a line has the step and eta alone,
    so a figure is never repeated as if it were new."""

    def __init__(self, every: int | None = None) -> None:
        super().__init__()
        self.every, self._enabled = every, True
        self._start: tuple[float, int] | None = None
        self._logged = self._shown = -1  # the last step whose figures were logged, and the last one printed

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self._start = (time.monotonic(), trainer.global_step)  # a resumed run counts from where it resumed

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        step, total = trainer.global_step, trainer.max_steps
        if trainer._logger_connector.should_update_logs:  # this step's figures reached callback_metrics
            self._logged = step
        every = self.every or max(1, total // 20)
        if not (self._enabled and trainer.is_global_zero) or (step % every and step != total):
            return
        metrics = trainer.callback_metrics
        parts = [f"step {step}/{total}"]
        if self._logged > self._shown:
            at = "" if self._logged == step else f" @{self._logged}"
            if (loss := metrics.get(names.TRAIN_LOSS)) is not None:
                parts.append(f"loss {float(loss):.4f}{at}")
            if (rate := metrics.get(names.TOKENS_PER_S)) is not None:
                parts.append(f"{float(rate):,.0f} tok/s{at}")
            self._shown = self._logged
        if self._start is not None and step > self._start[1]:
            per_step = (time.monotonic() - self._start[0]) / (step - self._start[1])
            parts.append(f"eta {_duration(per_step * (total - step))}")
        print("  ".join(parts), flush=True)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        loss = trainer.callback_metrics.get(names.VAL_LOSS)
        if self._enabled and trainer.is_global_zero and not trainer.sanity_checking and loss is not None:
            print(f"val at step {trainer.global_step}: loss {float(loss):.4f}", flush=True)


def _duration(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    hours, m = divmod(minutes, 60)
    return f"{hours}h{m:02d}m" if hours else f"{m}m{s:02d}s" if m else f"{s}s"


def _on_a_terminal() -> bool:
    return sys.stdout.isatty() and sys.stderr.isatty()


def progress_bar() -> ProgressBar:
    """On a terminal what Lightning would pick (Rich when installed, else tqdm), labelled for step-based training;
    elsewhere plain lines."""
    if not _on_a_terminal():
        return PlainProgress()
    return StepsRichProgressBar() if _RICH_AVAILABLE else TQDMProgressBar()
