"""Su's position probe (data=position_probe, lmlab/data/probe.py): the task's data, its per-position metrics against a
hand computation, the study's sweep composing pair by pair, the position-blindness argument on the model itself, a
short training run leaving probe.json and summary figures, and compare's probe table and plot."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmlab import compose
from lmlab.run.training import train
from tests.runs import metric


def test_a_short_probe_run_leaves_its_metrics(tmp_path: Path) -> None:
    run = tmp_path / "run"
    overrides = ["experiment=position_probe", "position=learned", "model.max_seq_len=16", "trainer.max_steps=30",
                 "trainer.val_check_interval=15", "trainer.log_every_n_steps=5", "logger=none",
                 "monitor.every_n_steps=0", "schedule.warmup_steps=5", "optim.lr=1e-2"]
    summary = train(compose(overrides), run)
    probe = json.loads((run / "probe.json").read_text())
    assert probe["step"] == 30 and probe["position"] == list(range(1, 17)) and probe["chance_accuracy"] == 1 / 16
    assert summary["probe_accuracy"] == probe["mean_accuracy"] == pytest.approx(sum(probe["accuracy"]) / 16)
    assert summary["probe_error"] == probe["mean_error"]
    assert summary["probe_accuracy"] > 0.5  # learned positions solve it fast (1.0 in the study)
    assert json.loads((run / "summary.json").read_text())["probe_error"] == summary["probe_error"]
    accuracy = metric(run, "probe/accuracy")  # at each validation, on Lightning's logging step as val/loss
    assert len(accuracy) == 2 and set(accuracy) == set(metric(run, "val/loss"))
    assert accuracy[max(accuracy)] == pytest.approx(summary["probe_accuracy"], rel=1e-6)
    assert summary["unigram_val_loss"] == pytest.approx(math.log(16))
    from lmlab.analysis.evaluate import evaluate

    with pytest.raises(ValueError, match=r"data=position_probe, a task.*probe\.json"):  # said, not an AttributeError
        evaluate(run)
