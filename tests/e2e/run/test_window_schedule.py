"""attention.window_schedule across a resume: a run interrupted at the step its window grows and resumed reads, step by
step, the windows and the losses of the run trained straight through (the window is a function of the step alone)."""

from __future__ import annotations

import pytest
from lightning.pytorch.callbacks import Callback


class Windows(Callback):
    """Records the windows each step trained with, and each validation read: {(split, step): windows}."""

    def __init__(self, seen: dict[tuple[str, int], list]) -> None:
        self.seen = seen

    def on_train_batch_end(self, trainer, lit, *args) -> None:
        self.seen["train", lit._windowed[0].window_step[0]] = [int(m.window) for m in lit._windowed]

    def on_validation_batch_end(self, trainer, lit, *args) -> None:
        if not trainer.sanity_checking:
            self.seen["val", lit._windowed[0].window_step[0]] = [int(m.window) for m in lit._windowed]


def test_a_resume_at_a_window_stage_reads_the_uninterrupted_runs_windows(corpus, tmp_path) -> None:
    from tests.runs import metric_rows, straight_and_resumed

    extra = ("attention.window=16", "attention.pattern=[local,8]", "attention.window_schedule=[[0,8],[0.5,16]]",
             "trainer.max_steps=6", "trainer.val_check_interval=3", "schedule.warmup_steps=2")
    a, b = {}, {}
    straight, resumed = straight_and_resumed(corpus, tmp_path, *extra, at=3, watch=(Windows(a), Windows(b)))
    stage = {("train", s): [8, 4] if s < 3 else [16, 8] for s in range(6)}  # the long layer, the short one half
    assert a == b == {**stage, ("val", 3): [16, 8], ("val", 6): [16, 8]}  # validation: the step's window
    rows_a, rows_b = metric_rows(straight), metric_rows(resumed)
    assert len([s for s in rows_a if "val/loss" in rows_a[s]]) == 2
    for step, row in rows_a.items():
        for c in ("train/loss", "val/loss"):
            if c in row:
                assert float(rows_b[step][c]) == pytest.approx(float(row[c]), rel=1e-5), (step, c)
