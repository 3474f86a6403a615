"""downstream: in a training run: a local lm-eval task (examples/lm_eval/shakespeare_mc) scored at the validations
every_n_vals names and at the last one, in the val loss's row of metrics.csv and in TensorBoard, its last values in
summary.json equal to what eval.py harness= computes on the final weights; off by default, the run as before (and
on, its training unchanged); a resumed run scores at the same steps as an uninterrupted one."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import typing
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
pytest.importorskip("lm_eval")

from lmlab import compose  # noqa: E402
from lmlab.record.summary import RunSummary  # noqa: E402
from lmlab.run.training import train  # noqa: E402
from tests.runs import ROOT, straight_and_resumed, tiny  # noqa: E402

# validations after steps 2, 4, 6 (metrics.csv rows 1, 3, 5) and the one after the last step, 7 (row 7)
RUN = ("trainer.max_steps=7", "trainer.val_check_interval=2", "model.max_seq_len=64")
ON = ("downstream.tasks=[shakespeare_mc]", "downstream.every_n_vals=2", "downstream.limit=4")
SCORED = {"downstream/shakespeare_mc/acc", "downstream/shakespeare_mc/acc_norm"}


def _rows(run: Path) -> dict[int, dict[str, str]]:
    with open(run / "metrics.csv") as f:
        return {int(r["step"]): {k: v for k, v in r.items() if v} for r in csv.DictReader(f)}


def _columns(run: Path) -> list[str]:
    with open(run / "metrics.csv") as f:
        return next(csv.reader(f))


def _scored(run: Path) -> dict[int, dict[str, float]]:
    return {step: {k: float(v) for k, v in row.items() if k.startswith("downstream/")}
            for step, row in _rows(run).items() if any(k.startswith("downstream/") for k in row)}


@pytest.fixture
def at_root(monkeypatch) -> None:
    monkeypatch.chdir(ROOT)  # the example tasks' data_files are relative to the checkout's root


def test_a_run_scores_a_local_task_beside_the_val_loss(corpus: Path, tmp_path: Path, at_root) -> None:
    from lmlab.analysis.harness import run_harness
    from lmlab.run.downstream import metrics_of

    run, cache = tmp_path / "run", tmp_path / "cache"
    tensorboard = importlib.util.find_spec("tensorboard") is not None  # the dashboard extra
    args = [*(a for a in tiny(corpus, cache, *RUN, *ON) if not a.startswith("logger=")),
            "logger=tensorboard" if tensorboard else "logger=none"]
    summary = train(compose(args), run)

    scored, rows = _scored(run), _rows(run)
    assert sorted(scored) == [3, 7]  # every second validation (step 4) and the last (step 7), not steps 2 and 6
    assert all(set(scored[s]) == SCORED and "val/loss" in rows[s] for s in scored)  # beside the val loss
    assert all(0 <= v <= 1 for values in scored.values() for v in values.values())
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["downstream"] == summary["downstream"] == {"step": 7, "metrics": scored[7]}
    assert set(summary) <= set(typing.get_type_hints(RunSummary))  # declared: what summary.json's readers rely on

    # what eval.py harness= computes on the run's final weights (the lmlab route: the scoring the callback uses)
    standalone = run_harness(run, ["shakespeare_mc"], include="examples/lm_eval", limit=4, route="lmlab")
    assert metrics_of(standalone["results"]) == scored[7]

    if tensorboard:  # the run's other loggers get them at the same steps
        from tests.unit.record.test_tensorboard import _events

        scalars, _ = _events(run)
        assert {k: sorted(v) for k, v in scalars.items() if k in SCORED} == dict.fromkeys(SCORED, [3, 7])


def test_off_by_default_the_run_is_as_before(corpus: Path, tmp_path: Path, at_root) -> None:
    cache = tmp_path / "cache"
    off, on = tmp_path / "off", tmp_path / "on"
    train(compose(tiny(corpus, cache, *RUN)), off)
    train(compose(tiny(corpus, cache, *RUN, *ON)), on)
    assert _columns(off) == [c for c in _columns(on) if not c.startswith("downstream/")]
    assert not any(c.startswith("downstream") for c in _columns(off))
    assert "downstream" not in json.loads((off / "summary.json").read_text())
    for name in ("train/loss", "val/loss"):  # scoring changes nothing of the training (no random draw, no gradient)
        assert {s: r[name] for s, r in _rows(off).items() if name in r} == \
               {s: r[name] for s, r in _rows(on).items() if name in r}


def test_a_resumed_run_scores_at_the_same_steps(corpus: Path, tmp_path: Path, at_root) -> None:
    """Ctrl-C right after the validation of step 4 scored; the resume goes on from that checkpoint."""
    straight, resumed = straight_and_resumed(corpus, tmp_path, *RUN, *ON, at=4)
    assert sorted(_scored(straight)) == [3, 7]
    assert _scored(resumed) == _scored(straight)
    attempts = json.loads((resumed / "summary.json").read_text())
    assert attempts["downstream"] == json.loads((straight / "summary.json").read_text())["downstream"]
    assert [a["status"] for a in attempts["attempts"]] == ["interrupted", "completed"]
