"""experiment=optimizer_benchmark end to end, small: Hydra's launcher runs the grid (two optimizers, two lrs, two
seeds), then the study reads it back: every run scored on the two halves of its validation windows (their mean is the
run's own final val loss: the same windows, the same last weights), each optimizer's lr picked on the first half, the
verdict line per pair, the table and the picture; `eval.py compare=` carries the same section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.runs import ROOT, cli, tiny


def test_the_benchmark_tunes_each_optimizer_on_one_half_and_compares_on_the_other(corpus: Path, tmp_path: Path
                                                                                     ) -> None:
    sweep = tmp_path / "sweep"
    res = cli(str(ROOT / "train.py"), "-m", "experiment=optimizer_benchmark", "optim=adamw,lion", "optim.lr=1e-3,1e-2",
              "seed=0,1", *tiny(corpus, tmp_path / "cache"), "logger=csv", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    runs = sorted(p.parent for p in sweep.rglob("summary.json"))
    assert len(runs) == 8  # the command line's lists and width replace the experiment's grid
    res = cli("-m", "lmlab.analysis.studies", "optimizer_benchmark", str(sweep), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    for run in runs:
        summary = json.loads((run / "summary.json").read_text())
        held = json.loads((run / "held_out.json").read_text())
        assert held["windows"] == 16 and held["tune"] != held["test"]
        assert (held["tune"] + held["test"]) / 2 == pytest.approx(summary["final_val_loss"], abs=2e-4)
    out = json.loads((sweep / "optimizer_benchmark.json").read_text())
    assert [a["optim"] for a in out["arms"]] == ["adamw", "lion"]
    for arm in out["arms"]:  # the lr with the lower mean tune-half loss over the two seeds
        assert arm["lr"] == min(arm["tuning"], key=arm["tuning"].get) and arm["seeds"] == 2
    (pair,) = out["pairs"]
    assert pair["a"] == "lion" and pair["b"] == "adamw" and pair["n"] == [2, 2]
    assert pair["verdict"] in ("better", "worse", "not resolved")
    assert f"- lion vs adamw: {pair['verdict']} (" in res.stdout and "| adamw |" in res.stdout
    assert (sweep / "plots" / "optimizer_benchmark.png").stat().st_size > 10_000
    res = cli(str(ROOT / "eval.py"), f"compare={sweep}", cwd=tmp_path)
    assert res.returncode == 0 and "Optimizer benchmark" in res.stdout, res.stderr[-3000:]
