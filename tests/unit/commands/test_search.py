"""Hyper-parameter search: train.py returns the objective (the best val loss; +inf for a run that diverged, collapsed,
failed or was interrupted), so Hydra's sweepers can optimise it: hparams_search=optuna searches it end to end through
the CLI (a diverging or failing trial is the worst trial, not an error; the study resumes from the sweep directory),
and experiment=lr_sweep marks each architecture's best learning rate in `eval.py compare=`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lmlab import CONF_DIR
from lmlab.record.summary import objective


def _needs_optuna():
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason="the optuna extra: pip install -e '.[optuna]'")
    return pytest.importorskip("optuna")


@pytest.mark.parametrize(("summary", "expected"), [
    ({"status": "completed", "best_val_loss": 1.5, "final_val_loss": 1.7}, 1.5),
    ({"status": "completed", "best_val_loss": None}, math.inf),  # never validated
    ({"status": "completed", "best_val_loss": math.nan}, math.inf),
    ({"status": "diverged", "best_val_loss": 2.0}, math.inf),  # a val loss before the divergence doesn't count
    ({"status": "collapsed", "best_val_loss": 3.3}, math.inf),
    ({"status": "failed", "best_val_loss": 2.5}, math.inf),
    ({"status": "interrupted", "best_val_loss": 2.5}, math.inf),
    ({"status": "running"}, math.inf),
    (None, math.inf),  # no summary at all (a job that failed before training)
])
def test_objective_is_the_best_val_loss_of_a_completed_run(summary, expected: float) -> None:
    assert objective(summary) == expected


def test_the_search_config_searches_lr_and_warmup_in_the_sweep_dir() -> None:
    """hparams_search=optuna composes onto the plugin's sweeper schema (unresolved: resolving the storage would make
    the sweep directory)."""
    _needs_optuna()
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("train", overrides=["hparams_search=optuna"], return_hydra_config=True)
    search = OmegaConf.to_container(cfg.hydra.sweeper, resolve=False)
    assert search["_target_"].endswith("OptunaSweeper") and search["direction"] == "minimize"
    assert search["sampler"]["_target_"].endswith("TPESampler") and search["sampler"]["seed"] is not None
    assert search["params"]["optim.lr"].startswith("tag(log, interval(") and "schedule.warmup_steps" in search["params"]
    assert search["storage"] == "${lmlab.sqlite:${hydra.sweep.dir}/optuna.db}" and search["study_name"]
    assert cfg.optim.lr == 3e-3  # nothing else changes: a single run with it trains the defaults


def test_the_study_url_is_absolute_and_its_directory_exists(tmp_path: Path, monkeypatch) -> None:
    """The sweeper opens the study before Hydra makes the sweep directory, and SQLite makes no directories."""
    monkeypatch.chdir(tmp_path)
    url = OmegaConf.create({"storage": "${lmlab.sqlite:multirun/x/optuna.db}"}).storage
    assert url == f"sqlite:///{tmp_path / 'multirun' / 'x' / 'optuna.db'}" and (tmp_path / "multirun" / "x").is_dir()


def test_a_resumed_search_seeds_its_sampler_past_the_trials_it_holds(tmp_path: Path) -> None:
    """The study's trial count moves the seed: the random trials of a resumed search are new ones."""
    optuna = _needs_optuna()
    from lmlab import _study_seed

    db = tmp_path / "optuna.db"
    assert _study_seed(str(db), 1337) == 1337  # no study yet
    study = optuna.create_study(study_name="train", storage=f"sqlite:///{db}")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=3)
    assert _study_seed(str(db), 1337) == 1340
    (tmp_path / "junk.db").write_text("not sqlite")
    assert _study_seed(str(tmp_path / "junk.db"), 7) == 7  # Optuna reports a broken storage in its own words
