"""`eval.py compare=`: runs that differ only by `seed` are one variant (compare_variants: mean, sd and n of each
figure; compare: one row per run, as before), the curves plots draw each variant's seed band (mean +- sd over seeds
per step), and the best learning rate of each architecture is marked (best_lr)."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from tests.runs import ROOT, cli, tiny
from tests.unit.analysis.test_compare import _read


def test_cli_two_seed_sweep_gives_one_row_per_variant(corpus: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "trainer.val_"))]
    res = cli(str(ROOT / "train.py"), "-m", "seed=1,2", "placement=pre,post", *args, "trainer.max_steps=6",
              "trainer.val_check_interval=3", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli(str(ROOT / "eval.py"), f"compare={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "compare_variants.md" in res.stdout
    per_run = _read(sweep / "compare.csv")
    variants = _read(sweep / "compare_variants.csv")
    assert len(per_run) == 4 and sorted(r["placement"] for r in variants) == ["post", "pre"]
    for row in variants:
        runs = [r for r in per_run if r["placement"] == row["placement"]]
        bests = [float(r["best_val_loss"]) for r in runs]
        assert row["n"] == "2" and row["seeds"] == "1,2"
        assert float(row["best_val_loss_mean"]) == pytest.approx(statistics.mean(bests), rel=1e-3)
        assert float(row["best_val_loss_sd"]) == pytest.approx(statistics.stdev(bests), rel=1e-2, abs=1e-4)
        assert bests[0] != bests[1]  # the seeds really differ
    for png in ("train_loss.png", "val_loss.png", "grad_norm.png"):
        assert (sweep / "plots" / png).stat().st_size > 1000, png
