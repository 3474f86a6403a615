"""Hyper-parameter search: train.py returns the objective (the best val loss; +inf for a run that diverged, collapsed,
failed or was interrupted), so Hydra's sweepers can optimise it: hparams_search=optuna searches it end to end through
the CLI (a diverging or failing trial is the worst trial, not an error; the study resumes from the sweep directory),
and experiment=lr_sweep marks each architecture's best learning rate in `eval.py compare=`."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lmlab import CONF_DIR
from tests.runs import ROOT, cli, tiny
from tests.unit.commands.test_search import _needs_optuna


def _summaries(sweep: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep.rglob("summary.json")}


def _study(sweep: Path):
    optuna = _needs_optuna()
    (name,) = optuna.study.get_all_study_summaries(f"sqlite:///{sweep / 'optuna.db'}")
    return optuna.load_study(study_name=name.study_name, storage=f"sqlite:///{sweep / 'optuna.db'}")


def test_optuna_search_runs_end_to_end_and_bad_trials_are_the_worst(corpus: Path, tmp_path: Path) -> None:
    """3 trials through the real CLI, the learning rate a choice of a diverging 1e3, a sane 3e-3 and an invalid
    'abc' (that job raises before training): the diverged and the failed trial are complete trials with the value
    +inf, not errors; the search finishes and Hydra writes the best trial, and exits 1 naming the refused trial (a
    sweep whose jobs did not all run says so); re-running the same command on the same sweep dir adds to the same
    study."""
    optuna = _needs_optuna()
    sweep = tmp_path / "search"
    args = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "trainer.val_"))]
    command = [str(ROOT / "train.py"), "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=3", *args,
               "trainer.max_steps=10", "trainer.val_check_interval=5", "optim.grad_clip=0",
               "optim.lr=choice(1000,0.003,abc)", "hydra.sweeper.sampler.seed=1", f"hydra.sweep.dir={sweep}"]
    res = cli(*command, cwd=tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    assert res.stderr.strip().splitlines()[-2] == "train.py: 1 job(s) of the sweep did not run to an end:"
    trials = _study(sweep).trials
    assert sorted(map(str, (t.params["optim.lr"] for t in trials))) == ["0.003", "1000", "abc"], \
        "sampler seed 1 draws each choice once in the first 3 trials (optuna==2.10.1)"
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    statuses = {s["config"]["optim"]["lr"]: s["status"] for s in _summaries(sweep).values()}
    assert statuses == {1000: "diverged", 0.003: "completed"}  # 'abc' was refused before its run dir was written
    assert "optim.lr='abc' must be a float" in res.stderr  # the failure is reported, and the search went on
    values = {str(t.params["optim.lr"]): t.value for t in trials}
    assert values["1000"] == values["abc"] == math.inf
    completed = next(s for s in _summaries(sweep).values() if s["status"] == "completed")
    assert values["0.003"] == pytest.approx(completed["best_val_loss"])  # the objective is the run's best val loss
    best = OmegaConf.load(sweep / "optimization_results.yaml")
    assert best.best_params["optim.lr"] == 0.003 and best.best_value == pytest.approx(completed["best_val_loss"])

    res = cli(*[a.replace("n_trials=3", "n_trials=1") for a in command], cwd=tmp_path)  # resume the search
    trials = _study(sweep).trials
    assert len(trials) == 4
    assert res.returncode == (1 if str(trials[-1].params["optim.lr"]) == "abc" else 0), res.stderr[-3000:]


def test_a_single_run_that_raises_still_raises(tmp_path: Path) -> None:
    res = cli(str(ROOT / "train.py"), "model.n_head=3", "model.d_model=32", "logger=none",
              f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert res.returncode != 0 and "n_head=3" in res.stderr, res.stderr[-3000:]


def test_lr_sweep_marks_each_architectures_best_lr(corpus: Path, tmp_path: Path) -> None:
    """experiment=lr_sweep is a grid of architectures x learning rates; compare's best_lr column stars, for each
    architecture, the lr with the lowest best val loss (a diverged run never: its objective is +inf)."""
    study = OmegaConf.load(CONF_DIR / "experiment" / "lr_sweep.yaml").hydra.sweeper.params
    assert "optim.lr" in study and len(study) >= 2 and len(str(study["optim.lr"]).split(",")) >= 3
    arch = next(k for k in study if k != "optim.lr")
    sweep = tmp_path / "sweep"
    args = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "trainer.val_"))]
    res = cli(str(ROOT / "train.py"), "-m", "experiment=lr_sweep", *args, "trainer.max_steps=8",
              "trainer.val_check_interval=4", "optim.grad_clip=0", "optim.lr=1e3,3e-3,1e-2", f"hydra.sweep.dir={sweep}",
              cwd=tmp_path)  # the command line's lrs replace the study's: one of them diverges
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli(str(ROOT / "eval.py"), f"compare={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    with open(sweep / "compare.csv") as f:
        rows = list(csv.DictReader(f))
    archs = {r[arch] for r in rows}
    assert len(rows) == 3 * len(archs) and len(archs) >= 2
    for a in archs:
        group = [r for r in rows if r[arch] == a]
        starred = [r for r in group if r["best_lr"] == "*"]
        assert len(starred) == 1, group
        completed = [r for r in group if r["status"] == "completed"]
        assert starred[0]["best_val_loss"] == min(completed, key=lambda r: float(r["best_val_loss"]))["best_val_loss"]
        assert next(r for r in group if float(r["optim.lr"]) == 1000)["status"] == "diverged"
    assert "best_lr" in (sweep / "compare.md").read_text()


def test_a_resumed_search_adds_new_trials(corpus: Path, tmp_path: Path) -> None:
    """Re-running a search on its sweep dir (the default seed) adds trials with parameters it has not tried: the
    sampler was seeded as at the start before, and drew the same random trials again."""
    _needs_optuna()
    sweep = tmp_path / "search"
    args = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "trainer.val_"))]
    command = [str(ROOT / "train.py"), "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=2", *args,
               "trainer.max_steps=3", "trainer.val_check_interval=3", "schedule.warmup_steps=0",
               "monitor.every_n_steps=0", f"hydra.sweep.dir={sweep}"]
    for _ in range(2):
        res = cli(*command, cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
    lrs = [t.params["optim.lr"] for t in _study(sweep).trials]
    assert len(lrs) == 4 and len(set(lrs)) == 4, lrs
    assert len(list(sweep.glob("*/summary.json"))) == 4  # four runs trained, none a repeat
