"""`downstream:` (conf/train.yaml): lm-eval tasks scored during training, logged beside the val loss.

At a validation at step s, when s is a multiple of `every_n_vals` x trainer.val_check_interval (the step decides, so
a resumed run scores at the steps the uninterrupted one would), and at the run's last validation (at
trainer.max_steps, or the one after an early stop), each task of `downstream.tasks` is scored on the model as the
validation saw it (eval mode, no gradients; schedule-free's evaluation weights): lm-eval's own `evaluate` over
`ScoringLM` (lmlab.run.scoring, the scoring `eval.py harness=` uses through the lmlab route), on the task's first
`limit` documents (null: all of them), the same documents every time. Every metric the task reports is logged as
`downstream/<task>/<metric>` (acc, acc_norm, word_perplexity, bits_per_byte, ...; `<metric>/<filter>` for a filter
other than lm-eval's `none`) in the val loss's row (Lightning's logging step: s - 1 for a validation during fit),
through the run's loggers (metrics.csv, W&B, TensorBoard); summary.json keeps the last values (`downstream`: their
step s, in optimizer steps like `val_curve`, and metrics).

A task is one of examples/lm_eval/'s by name, or the path of a task YAML file (lmlab.run.checks.downstream_task):
a task whose data lm-eval fetches from the Hub cannot run offline, and generation tasks (generate_until) are left to
`eval.py harness=` after training. Every rank scores (FSDP2's forward needs them all; the numbers are the same on
each), rank zero logs. Nothing goes into the checkpoint: a resumed run carries the last values of the previous
summary.json until it scores again.
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from lmlab import names
from lmlab.record.tracking import log_at
from lmlab.run.checks import downstream_task
from lmlab.run.scoring import SCORED, ScoringLM, load_tasks, prefix_token, score


def metrics_of(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """lm-eval's results per task (`{"acc,none": 0.4, "acc_stderr,none": "N/A", "alias": ...}`) as lmlab's metric
    names: downstream/<task>/<metric>, `<metric>/<filter>` for a filter other than `none`; no standard errors."""
    out = {}
    for task, values in results.items():
        for key, value in values.items():
            metric, sep, filt = key.partition(",")
            if not sep or metric.endswith("_stderr") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            out[names.downstream(task, metric if filt == "none" else f"{metric}/{filt}")] = float(value)
    return out


@contextlib.contextmanager
def _quiet():
    """lm-eval's per-task progress bar (lm_eval.api.task's tqdm) off while it scores: a line per task per validation
    would cut through the training's own progress."""
    import lm_eval.api.task as task_module

    bar = getattr(task_module, "tqdm", None)
    if bar is not None:
        task_module.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            task_module.tqdm = bar


class Downstream(Callback):
    """Scores `tasks` (downstream.tasks entries) at the validations of the steps `every` divides and at the run's
    last validation; `last`: the latest values ({"step": s, "metrics": {name: value}}), what summary.json keeps."""

    def __init__(self, tasks: list[str], tokenizer: Any, *, every: int, limit: int | None = None,
                 last: dict[str, Any] | None = None) -> None:
        files = [downstream_task(spec).resolve() for spec in tasks]  # refused by name (lmlab.run.checks)
        try:
            self.loaded = load_tasks(files)
        except Exception as err:  # noqa: BLE001  (a data file not found, a template that does not parse, ...)
            raise ValueError(f"downstream.tasks={list(tasks)}: lm-eval could not load them ({type(err).__name__}: "
                             f"{err}); a task's data_files are relative to the working directory, {Path.cwd()}") \
                from err
        generating = [n for n, t in self.loaded["tasks"].items() if t.get_config("output_type") not in SCORED]
        if generating:
            raise ValueError(f"downstream.tasks: {', '.join(generating)} generate text (output_type generate_until); "
                             f"during training lmlab scores {', '.join(SCORED)} tasks: run generation tasks after "
                             f"training with eval.py run=<run> harness=...")
        try:
            prefix_token(tokenizer)  # what a text scored on its own starts from
        except ValueError as err:
            raise ValueError(f"downstream.tasks: {err}: this run's tokenizer cannot score lm-eval's texts") from None
        self.tokenizer, self.every, self.limit = tokenizer, int(every), limit
        self.last = last

    def due(self, trainer) -> bool:
        """Whether this validation scores the tasks: a step `every` divides, the last step, or the validation that
        training.py runs after an early stop (trainer.validate)."""
        step, last = trainer.global_step, trainer.max_steps  # (Lightning's -1: no limit)
        return step % self.every == 0 or 0 < last <= step or trainer.state.fn == "validate"

    def measure(self, model) -> dict[str, float]:
        """downstream/<task>/<metric> of `model` now, in eval mode (its mode is put back after)."""
        was_training = model.training
        try:
            with _quiet():
                return metrics_of(score(ScoringLM(model, self.tokenizer), self.loaded, self.limit))
        finally:
            model.train(was_training)

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking or not self.due(trainer):
            return
        metrics = self.measure(pl_module.model)
        self.last = {"step": trainer.global_step, "metrics": metrics}
        # into the row Lightning logged this validation's val/loss at, its own logging step: the steps before this
        # validation's during fit (metrics.csv's val/loss of step 200 is at 199), all of them in trainer.validate
        log_at(trainer, metrics, trainer.fit_loop.epoch_loop._batches_that_stepped)

    def figures(self) -> dict[str, Any]:
        """What summary.json records: `downstream`, the last values and their step (None before any)."""
        return {"downstream": self.last}


def carried(previous: dict[str, Any] | None, resume_step: int) -> dict[str, Any] | None:
    """A resumed run's last values until it scores again: the previous summary.json's `downstream`, when they were
    scored at or before the checkpoint it resumes from (`resume_step`); None otherwise."""
    last = (previous or {}).get("downstream")
    if isinstance(last, dict) and isinstance(last.get("step"), int) and last["step"] <= resume_step:
        return last
    return None
