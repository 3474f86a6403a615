"""`python -m lmlab.record.plots`: any metric of a sweep's runs vs step, and eval.py's loss vs length per run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmlab.record.plots import main, plot_length_sweep, sweep_runs


def _run(sweep: Path, name: str, change: list[float]) -> Path:
    run = sweep / name
    run.mkdir(parents=True)
    lines = ["epoch,step,train/loss,update/output_change"]
    lines += [f"0,{i},{3.0 - 0.1 * i},{c}" for i, c in enumerate(change)]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")
    return run


def test_runs_are_named_by_the_overrides_they_do_not_share(tmp_path: Path) -> None:
    post = _run(tmp_path, "experiment=deep_scale,placement=post", [1.0, 0.5])
    pre = _run(tmp_path, "experiment=deep_scale,placement=pre", [0.1, 0.05])
    (tmp_path / "experiment=deep_scale,placement=pre" / "wandb").mkdir()
    (tmp_path / "experiment=deep_scale,placement=pre" / "wandb" / "metrics.csv").write_text("step\n")
    assert sweep_runs(tmp_path) == {"placement=post": post, "placement=pre": pre}
    assert sweep_runs(tmp_path / "experiment=deep_scale,placement=post") == {"experiment=deep_scale,placement=post":
                                                                             post}


def test_curves_plots_any_metric_and_refuses_one_no_run_logged(tmp_path: Path) -> None:
    _run(tmp_path, "placement=post", [1.0, 0.5, 0.25])
    _run(tmp_path, "placement=pre", [0.1, 0.05, 0.02])
    out = tmp_path / "change.png"
    main(["curves", str(tmp_path), "update/output_change", "--log", "--out", str(out)])
    assert out.stat().st_size > 1000
    with pytest.raises(SystemExit, match="logged act/rms"):
        main(["curves", str(tmp_path), "act/rms", "--out", str(tmp_path / "none.png")])


def test_lengths_reads_each_runs_unscaled_eval_rows(tmp_path: Path, monkeypatch) -> None:
    for score, losses in {"relu2": [2.0, 3.0], "softmax": [2.0, 2.5]}.items():
        run = _run(tmp_path, f"block.score={score}", [1.0])
        rows = [{"length": n, "rope_scaling": s, "loss": loss + (s != "none"), "loss_beyond": None}
                for n, loss in zip((64, 128), losses) for s in ("none", "yarn")]
        (run / "eval").mkdir()
        (run / "eval" / "eval.json").write_text(json.dumps({"trained_len": 64, "rows": rows}))
    drawn = {}
    monkeypatch.setattr("lmlab.record.plots.plot_length_sweep",  # record what is drawn, then draw it for real
                        lambda rows, trained, out, **kw: drawn.update(rows=rows, trained=trained, **kw)
                        or plot_length_sweep(rows, trained, out, **kw))
    out = tmp_path / "len.png"
    main(["lengths", str(tmp_path), "--out", str(out)])
    assert out.stat().st_size > 1000
    assert drawn["trained"] == 64 and drawn["by"] == "run" and drawn["column"] == "loss"
    assert sorted((r["run"], r["length"], r["loss"]) for r in drawn["rows"]) == [
        ("block.score=relu2", 64, 2.0), ("block.score=relu2", 128, 3.0),
        ("block.score=softmax", 64, 2.0), ("block.score=softmax", 128, 2.5)]


def test_the_init_profile_has_a_tick_per_layer_and_no_fractional_ones() -> None:
    """Layers are counted: a 4-layer profile gets ticks 0, 1, 2, 3 (matplotlib's default put 0.5, 1.5, ... between)."""
    from lmlab.record.plots import init_profile_axes

    fig, ax = init_profile_axes({"pre": {f"layer_0{i}": 1.0 + i for i in range(4)} | {"embed": 3.0}})
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks == [0.0, 1.0, 2.0, 3.0], ticks
    fig.clf()
