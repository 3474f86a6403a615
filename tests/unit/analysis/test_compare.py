"""`eval.py compare=`: runs that differ only by `seed` are one variant (compare_variants: mean, sd and n of each
figure; compare: one row per run, as before), the curves plots draw each variant's seed band (mean +- sd over seeds
per step), and the best learning rate of each architecture is marked (best_lr)."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest

from lmlab.analysis.compare import compare, find_runs
from lmlab.record.plots import seed_band


def _fake_run(sweep: Path, overrides: list[str], status: str = "completed", best: float = 2.0, final: float = 2.1,
              losses: tuple[float, ...] = (4.0, 3.0, 2.5)) -> Path:
    """A run directory as train.py leaves it: summary.json and metrics.csv (train/loss every step)."""
    run = sweep / ",".join(overrides)
    run.mkdir(parents=True)
    summary = {"status": status, "steps": len(losses), "overrides": overrides, "final_val_loss": final,
               "best_val_loss": best, "unigram_val_loss": 3.0, "peak_grad_norm": 1.5, "tokens_per_s": 1000.0,
               "diverged_at_step": 2 if status == "diverged" else None}
    (run / "summary.json").write_text(json.dumps(summary))
    rows = "".join(f"{s},{v}\n" for s, v in enumerate(losses))
    (run / "metrics.csv").write_text("step,train/loss\n" + rows)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"")  # compare must find the run once, not twice
    return run


def _read(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_runs_that_differ_only_by_seed_are_one_variant(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    figures = {("pre", "1"): (2.0, 2.2), ("pre", "2"): (2.2, 2.3), ("post", "1"): (2.5, 2.6), ("post", "2"): (2.9, 3.0)}
    for (placement, seed), (best, final) in figures.items():
        _fake_run(sweep, ["model.n_layer=2", f"placement={placement}", f"seed={seed}"], best=best, final=final)
    assert len(find_runs(sweep)) == 4
    compare(sweep)
    per_run = _read(sweep / "compare.csv")
    assert len(per_run) == 4 and {r["seed"] for r in per_run} == {"1", "2"}  # the per-seed table, as before
    assert [r["placement"] for r in per_run] == ["post", "post", "pre", "pre"]  # sorted by the overrides' values
    variants = {r["placement"]: r for r in _read(sweep / "compare_variants.csv")}
    assert set(variants) == {"pre", "post"} and "seed" not in next(iter(variants.values()))
    for placement, row in variants.items():
        bests = [figures[(placement, s)][0] for s in ("1", "2")]
        finals = [figures[(placement, s)][1] for s in ("1", "2")]
        assert row["n"] == "2" and row["seeds"] == "1,2" and row["status"] == "completed"
        assert float(row["best_val_loss_mean"]) == pytest.approx(statistics.mean(bests))
        assert float(row["best_val_loss_sd"]) == pytest.approx(statistics.stdev(bests))  # sample sd (n - 1)
        assert float(row["final_val_loss_mean"]) == pytest.approx(statistics.mean(finals))
        assert float(row["loss_vs_unigram_mean"]) == pytest.approx(statistics.mean(finals) - 3.0)
        assert float(row["tokens_per_s_mean"]) == 1000.0 and float(row["tokens_per_s_sd"]) == 0.0
    md = (sweep / "compare_variants.md").read_text()
    assert "± " in md and "| pre |" in md  # mean ± sd in one cell
    assert (sweep / "plots" / "train_loss.png").stat().st_size > 1000


def test_a_variant_of_one_run_has_no_sd_and_mixed_statuses_are_counted(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _fake_run(sweep, ["norm=layer", "seed=1"])
    _fake_run(sweep, ["norm=layer", "seed=2"], status="diverged", best=None, final=None)
    _fake_run(sweep, ["norm=rms", "seed=1"], best=1.9)
    compare(sweep)
    variants = {r["norm"]: r for r in _read(sweep / "compare_variants.csv")}
    assert variants["rms"]["n"] == "1" and variants["rms"]["best_val_loss_sd"] == ""
    layer = variants["layer"]
    assert layer["n"] == "2" and "completed 1" in layer["status"] and "diverged 1" in layer["status"]
    assert float(layer["best_val_loss_mean"]) == 2.0  # over the seeds that have the figure


def test_best_lr_is_marked_per_architecture_and_per_variant(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    losses = {("pre", "0.001"): (2.3, 2.4), ("pre", "0.003"): (2.0, 2.1), ("pre", "0.01"): (None, None),
              ("post", "0.001"): (2.5, 2.5), ("post", "0.003"): (2.4, 2.9), ("post", "0.01"): (3.3, 3.3)}
    for (placement, lr), per_seed in losses.items():
        for seed, best in zip((1, 2), per_seed):
            _fake_run(sweep, [f"placement={placement}", f"optim.lr={lr}", f"seed={seed}"],
                      status="diverged" if best is None else "completed", best=best or 5.0)
    compare(sweep)
    variants = _read(sweep / "compare_variants.csv")
    starred = {(r["placement"], r["optim.lr"]) for r in variants if r["best_lr"] == "*"}
    assert starred == {("pre", "0.003"), ("post", "0.001")}  # post: 2.5 on average beats 2.65
    per_run = _read(sweep / "compare.csv")  # per run, the lr is compared among the runs of the same seed
    starred = {(r["placement"], r["optim.lr"], r["seed"]) for r in per_run if r["best_lr"] == "*"}
    assert starred == {("pre", "0.003", "1"), ("pre", "0.003", "2"), ("post", "0.003", "1"), ("post", "0.001", "2")}


def test_no_best_lr_without_lrs_to_compare(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _fake_run(sweep, ["norm=layer"])
    _fake_run(sweep, ["norm=rms"])
    compare(sweep)
    assert "best_lr" not in _read(sweep / "compare.csv")[0]
    search = tmp_path / "search"  # an Optuna search varies every key: no two runs share the other overrides
    _fake_run(search, ["optim.lr=0.001", "schedule.warmup_steps=10"], best=2.0)
    _fake_run(search, ["optim.lr=0.002", "schedule.warmup_steps=50"], best=1.9)
    compare(search)
    assert [r["best_lr"] for r in _read(search / "compare.csv")] == ["", ""]


def test_seed_band_is_the_mean_and_sd_over_seeds_per_step() -> None:
    a = {"train/loss": [(0, 4.0), (1, 3.0), (2, 2.0)]}
    b = {"train/loss": [(0, 5.0), (1, 4.0), (2, 3.0), (3, 2.5)]}  # a step the other seed doesn't have
    steps, mean, sd = seed_band([a, b], "train/loss")
    assert steps == [0, 1, 2, 3]
    assert mean == pytest.approx([4.5, 3.5, 2.5, 2.5])
    assert sd[:3] == pytest.approx([statistics.stdev([4.0, 5.0])] * 3) and sd[3] == 0.0  # one seed: no band


def test_malformed_summaries_are_flagged_and_the_rest_compared(tmp_path: Path) -> None:
    """One bad summary.json (not an object, a number JSON can hold but a float cannot, no status, not JSON, a model
    too large to rebuild) used to abort the whole comparison."""
    import time

    sweep = tmp_path / "sweep"
    for placement, best in (("pre", 2.0), ("post", 2.5)):
        _fake_run(sweep, [f"placement={placement}"], best=best, final=best + 0.1)
    bad = {"a_string": '"completed"', "a_list": "[1, 2]", "huge": '{"status": "completed", "best_val_loss": 1' +
           "0" * 400 + "}", "no_status": '{"steps": 3}', "not_json": '{"status": "comp', "huge_model": json.dumps(
               {"status": "completed", "overrides": ["placement=deep"], "model": {
                   "vocab_size": 65, "n_layer": 10**6, "d_model": 1024, "n_head": 8}})}
    for name, text in bad.items():
        run = sweep / name
        run.mkdir()
        (run / "summary.json").write_text(text)
    started = time.monotonic()
    rows, md = compare(sweep)
    assert time.monotonic() - started < 60  # the huge model is not rebuilt
    by_run = {r["run"]: r for r in rows}
    assert by_run["placement=pre"]["status"] == "completed" and by_run["placement=pre"]["best_val_loss"] == 2.0
    assert by_run["placement=post"]["best_val_loss"] == 2.5
    reasons = {"a_string": "holds a str, not an object", "a_list": "holds a list", "no_status": "has no status",
               "huge": "best_val_loss='1000", "not_json": "is not valid JSON"}
    for name, reason in reasons.items():
        assert by_run[name]["status"] == "malformed" and reason in by_run[name]["problem"], by_run[name]
    assert by_run["huge_model"]["status"] == "completed" and by_run["huge_model"]["ffn_params"] is None
    table = {r["run"]: r for r in _read(sweep / "compare.csv")}
    assert table["no_status"]["status"] == "malformed" and table["no_status"]["problem"] == "summary.json has no status"
    assert "malformed" in md and "placement=pre" in md


def _validated(sweep: Path, name: str, val: list[tuple[int, float]]) -> Path:
    """A fake run whose summary's val_curve and metrics.csv's val/loss rows are `val`."""
    run = _fake_run(sweep, [name], best=min(v for _, v in val), final=val[-1][1])
    summary = json.loads((run / "summary.json").read_text())
    (run / "summary.json").write_text(json.dumps({**summary, "val_curve": val, "tokens_per_step": 256,
                                                  "flops_per_token": 1e5}))
    rows = "".join(f"{s},{3.0 - s / 100},\n" for s in range(40)) + "".join(f"{s - 1},,{v}\n" for s, v in val)
    (run / "metrics.csv").write_text("step,train/loss,val/loss\n" + rows)
    return run


def test_compare_says_why_val_loss_png_and_the_to_target_columns_are_empty_of_information(tmp_path: Path) -> None:
    """Each run validated once (at its last step): no val_loss.png and *_to_target columns that only repeat each
    run's length; compare says both, in what it prints and in compare.md, and the next sweep, validated 4 times,
    draws the plot and says nothing."""
    once = tmp_path / "once"
    _validated(once, "norm=layer", [(40, 2.0)])
    _validated(once, "norm=rms", [(40, 2.6)])
    _, md = compare(once, target=2.7)
    assert not (once / "plots" / "val_loss.png").exists() and (once / "plots" / "train_loss.png").exists()
    notes = [line for line in md.splitlines() if line.startswith("Note: ")]
    assert len(notes) == 3, md
    assert notes[0].startswith("Note: plots/val_loss.png not drawn: each run validated once") and \
        "trainer.val_check_interval" in notes[0]
    assert notes[1] == "Note: plots/grad_norm.png not drawn: no run logged grad/norm at two steps or more"
    assert notes[2].startswith("Note: steps_to_target, tokens_to_target, flops_to_target, time_to_target_s carry no "
                               "information: each run validated once")
    assert (once / "compare.md").read_text().startswith("\n".join(notes) + "\n\n| norm |")
    rows = {r["norm"]: r for r in _read(once / "compare.csv")}
    assert rows["layer"]["steps_to_target"] == rows["rms"]["steps_to_target"] == "40.0"  # 0.6 nats apart, the same

    often = tmp_path / "often"
    _validated(often, "norm=layer", [(10, 2.9), (20, 2.5), (30, 2.2), (40, 2.0)])
    _validated(often, "norm=rms", [(10, 3.0), (20, 2.9), (30, 2.8), (40, 2.6)])
    _, md = compare(often, target=2.7)
    assert [line for line in md.splitlines() if line.startswith("Note: ")] == [notes[1]]  # the grad norm alone
    assert (often / "plots" / "val_loss.png").exists()
    rows = {r["norm"]: r for r in _read(often / "compare.csv")}
    assert float(rows["layer"]["steps_to_target"]) < 20 < 30 < float(rows["rms"]["steps_to_target"]) < 40
