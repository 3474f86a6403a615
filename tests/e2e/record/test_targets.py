"""A run's steps, tokens, FLOPs and time to its own target val losses (train.yaml's `targets:`, lmlab.record.targets):
worked
out by hand on a val curve in optimizer steps, refused by key when they are not val losses, and, end to end, the same
numbers in summary.json, in the W&B run's summary read back with W&B's own reader, and in `eval.py compare=`."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lmlab import compose
from lmlab.analysis.compare import compare
from lmlab.record.targets import TARGET_FIGURES
from lmlab.run.training import train
from tests.e2e.record.test_wandb import wandb_runs, wandb_tiny
from tests.runs import metric


def test_a_run_reports_its_targets_in_summary_json_wandb_and_compare(corpus: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    run = sweep / "run"
    # 100: reached at the first validation (step 3); 0.01: never
    summary = train(compose(wandb_tiny(corpus, tmp_path / "cache", "targets=[100,0.01]")), run)
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["to_target"] == summary["to_target"]
    assert [s for s, _ in on_disk["val_curve"]] == [3, 6]  # optimizer steps (metrics.csv logs the first at step 2)
    assert sorted(metric(run, "val/loss")) == [2, 5]
    reached, never = on_disk["to_target"]
    tokens_per_step = 8 * 32  # data.batch_size × model.max_seq_len
    assert reached["target"] == 100.0 and reached["steps_to_target"] == 3.0
    assert reached["tokens_to_target"] == 3 * tokens_per_step
    assert reached["flops_to_target"] == pytest.approx(3 * tokens_per_step * on_disk["flops_per_token"])
    assert reached["time_to_target_s"] == pytest.approx(on_disk["wall_time_s"] * 3 / 6)
    assert never == {"target": 0.01, **dict.fromkeys(TARGET_FIGURES)}

    (w,) = wandb_runs(run)  # what W&B shows: `wandb leet inspect --summary --json`
    shown = w["summary"]
    assert shown["steps_to_target_100"] == 3.0 and shown["tokens_to_target_100"] == 3 * tokens_per_step
    assert shown["flops_to_target_100"] == pytest.approx(reached["flops_to_target"])
    assert shown["time_to_target_s_100"] == pytest.approx(reached["time_to_target_s"])
    assert all(shown.get(f"{fig}_0p01") is None for fig in TARGET_FIGURES)
    assert w["config"]["targets"] == [100, 0.01]

    _, md = compare(sweep)  # compare counts to the run's first target, with the same numbers
    assert "Target val loss for *_to_target: 100" in md
    with open(sweep / "compare.csv") as f:
        (row,) = csv.DictReader(f)
    for fig in TARGET_FIGURES:
        assert float(row[fig]) == pytest.approx(reached[fig]), fig
