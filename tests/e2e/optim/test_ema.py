"""optim.ema through the training loop: validation logs val/ema_loss beside val/loss, summary.json has the EMA's final
val loss, the checkpoint holds the EMA beside the live weights (loadable by lmlab's weights_only loader), the live
figures are those of the same run without an EMA, and Ctrl-C then resume=true gives the straight run's metrics.csv
row for row."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from lmlab import compose, names
from lmlab.record.rundir import load_checkpoint, load_run
from lmlab.run.training import train
from tests.runs import ROOT, CtrlC, cli, tiny

EMA = ("optim.ema=0.9", "trainer.max_steps=20")


def _rows(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in csv.DictReader(f)]


@pytest.fixture(scope="module")
def straight(corpus: Path, tmp_path_factory) -> tuple[Path, Path, dict]:
    base = tmp_path_factory.mktemp("ema")
    summary = train(compose(tiny(corpus, base / "cache", *EMA)), base / "run")
    return base / "run", base / "cache", summary


def test_validation_logs_the_ema_loss_and_the_summary_has_its_last(straight) -> None:
    run, _, summary = straight
    assert summary["status"] == "completed" and summary["steps"] == 20
    ema = {int(r["step"]): float(r[names.VAL_EMA_LOSS]) for r in _rows(run) if r.get(names.VAL_EMA_LOSS)}
    live = {int(r["step"]): float(r[names.VAL_LOSS]) for r in _rows(run) if r.get(names.VAL_LOSS)}
    assert sorted(ema) == sorted(live) == [9, 19]  # Lightning's 0-based step of each validation (10 and 20 done)
    assert all(ema[s] != live[s] for s in ema)  # another set of weights was evaluated
    assert ema[19] < ema[9]  # it learns too
    assert summary["final_val_ema_loss"] == pytest.approx(ema[19], rel=1e-6)
    assert summary["final_val_loss"] == pytest.approx(live[19], rel=1e-6)


def test_the_checkpoint_holds_the_ema_beside_the_live_weights(straight) -> None:
    run, _, _ = straight
    ckpt = load_checkpoint(run / "checkpoints" / "last.ckpt", "run")  # lmlab's weights_only loader
    ema = ckpt["lmlab"]["ema_weights"]
    saved = load_run(run)
    assert set(ema) <= set(saved.weights) and "wte.weight" in ema
    assert all(v.dtype == torch.float32 for v in ema.values())
    assert any(not torch.equal(v, saved.weights[k]) for k, v in ema.items())
    model = saved.build()
    for k, v in model.state_dict().items():
        assert torch.equal(v, saved.weights[k]), k  # build() reads the live weights, as before
    averaged = saved.build(weights="ema")
    for k, v in ema.items():
        assert torch.equal(averaged.get_parameter(k).detach(), v), k
    with pytest.raises(ValueError, match="weights='x'.*live, ema"):
        saved.build(weights="x")


def test_eval_reads_the_live_weights_or_with_weights_ema_the_average(straight) -> None:
    """On the validation's 32 windows, eval.py's loss is val/loss, and with weights=ema val/ema_loss, written apart
    (<run>/eval_ema) so the live evaluation stays."""
    import json

    from lmlab.analysis.evaluate import evaluate

    run, _, summary = straight
    live = evaluate(run, max_windows=32)["rows"][0]["loss"]
    assert live == pytest.approx(summary["final_val_loss"], rel=1e-5)
    res = cli(str(ROOT / "eval.py"), f"run={run}", "weights=ema", "max_windows=32", cwd=run)
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads((run / "eval_ema" / "eval.json").read_text())
    assert result["weights"] == "ema" and not (run / "eval").exists()
    assert result["rows"][0]["loss"] == pytest.approx(summary["final_val_ema_loss"], rel=1e-5)
    assert abs(result["rows"][0]["loss"] - live) > 1e-3
    res = cli(str(ROOT / "eval.py"), f"run={run}", "weights=ema", "export=hf", f"out={run / 'hf'}", cwd=run)
    assert res.returncode == 2 and "weights=ema" in res.stderr + res.stdout and not (run / "hf").exists()


def test_the_live_figures_are_those_of_the_run_without_an_ema(straight, corpus: Path, tmp_path: Path) -> None:
    """optim.ema=0 (the default) logs no val/ema_loss, its summary no final_val_ema_loss, and every other figure of
    metrics.csv equals the EMA run's: averaging and evaluating the EMA leave the training alone."""
    run, cache, _ = straight
    summary = train(compose(tiny(corpus, cache, *EMA[1:])), tmp_path / "off")
    off = _rows(tmp_path / "off")
    assert names.VAL_EMA_LOSS not in off[0] and "final_val_ema_loss" not in summary
    assert "ema_weights" not in load_checkpoint(tmp_path / "off" / "checkpoints" / "last.ckpt", "run")["lmlab"]
    with pytest.raises(ValueError, match="weights=ema: .* has no weight EMA"):
        load_run(tmp_path / "off").build(weights="ema")
    assert [{k: v for k, v in r.items() if k != names.VAL_EMA_LOSS} for r in _rows(run)] == off


def test_ctrl_c_then_resume_gives_the_straight_run_row_for_row(straight, corpus: Path, tmp_path: Path) -> None:
    """Stopped at step 13, between the validations at 10 and 20: the EMA at 20 is only the straight run's if the
    resume took the checkpoint's average (a fresh one from the live weights would give another val/ema_loss)."""
    run_straight, cache, summary_straight = straight
    run = tmp_path / "run"
    with pytest.raises(SystemExit):
        train(compose(tiny(corpus, cache, *EMA)), run, callbacks=[CtrlC(at=13)])
    summary = train(compose(tiny(corpus, cache, *EMA, "resume=true")), run)
    assert summary["status"] == "completed" and summary["steps"] == 20
    assert _rows(run) == _rows(run_straight)
    assert summary["final_val_ema_loss"] == summary_straight["final_val_ema_loss"]
