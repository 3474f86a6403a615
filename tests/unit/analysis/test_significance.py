"""Paired tests over seeds (lmlab.analysis.significance), steps to a target loss (lmlab.record.targets) and compare's sections."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from scipy import stats

from lmlab.analysis.compare import compare
from lmlab.analysis.significance import holm, paired, seeds_needed, verdict
from lmlab.record.targets import crossing, to_target


def test_paired_t_by_hand_and_against_scipy() -> None:
    base = {"1": 2.00, "2": 2.10, "3": 1.95}
    var = {"1": 2.10, "2": 2.30, "3": 2.25, "4": 9.0}  # seed 4 has no baseline: left out
    t = paired(base, var)
    # differences 0.1, 0.2, 0.3: mean 0.2, sd 0.1, se 0.1/√3, t = 2√3 = 3.4641 on 2 df
    assert t.n == 3 and t.mean == pytest.approx(0.2) and t.sd == pytest.approx(0.1)
    assert t.p == pytest.approx(0.074180, abs=1e-6)  # 2·(1 − F_t2(2√3)) = 1 − 2√3/√(2 + 12) (t with 2 df, closed form)
    assert t.p == pytest.approx(1 - 2 * math.sqrt(3) / math.sqrt(14))
    half = 4.302653 * 0.1 / math.sqrt(3)  # t_{0.975, 2} = 4.302653 (tables)
    assert (t.low, t.high) == pytest.approx((0.2 - half, 0.2 + half), abs=1e-6)
    ref = stats.ttest_rel([var[s] for s in "123"], [base[s] for s in "123"])
    assert t.p == pytest.approx(ref.pvalue) and t.mean / (t.sd / math.sqrt(3)) == pytest.approx(ref.statistic)
    ci = ref.confidence_interval(0.95)
    assert (t.low, t.high) == pytest.approx((ci.low, ci.high))


def test_paired_degenerate_cases() -> None:
    assert paired({"1": 1.0}, {"2": 1.0}).n == 0
    one = paired({"1": 1.0}, {"1": 1.5})
    assert one.n == 1 and one.mean == 0.5 and one.p is None
    same = paired({"1": 1.0, "2": 2.0}, {"1": 1.5, "2": 2.5})  # the same difference on every seed
    assert same.sd == 0.0 and same.p == 0.0 and same.low == same.high == 0.5


def test_holm_on_fixed_numbers() -> None:
    # sorted 0.01, 0.02, 0.04 (m = 3): 0.03, 0.04, max(0.04, 0.04) = 0.04; None stays out of the family
    assert holm([0.04, None, 0.01, 0.02]) == pytest.approx([0.04, None, 0.03, 0.04], nan_ok=True)
    assert holm([0.5, 0.6]) == [1.0, 1.0]  # capped at 1 and monotone
    assert holm([0.03, 0.02]) == pytest.approx([0.04, 0.04])  # monotone: the larger p is not adjusted below


def test_seed_advice() -> None:
    # effect size 1 (mean = sd): n ≥ (t_{.975,n-1} + t_{.8,n-1})² holds first at n = 10 (9.0 < 10 ≥ 9.97)
    n = seeds_needed(0.01, 0.01)
    lhs = lambda k: (stats.t.ppf(0.975, k - 1) + stats.t.ppf(0.8, k - 1)) ** 2  # noqa: E731
    assert n == 10 and n >= lhs(n) and n - 1 < lhs(n - 1)
    assert seeds_needed(0.01, 0.005) < n < seeds_needed(0.01, 0.02)  # more spread, more seeds
    assert seeds_needed(0.0, 0.01) == 1001 and seeds_needed(0.1, None) is None
    assert verdict(3, 0.01).startswith("yes") and verdict(3, 0.2).startswith("no") and "no test" in verdict(1, None)


def test_crossing_is_interpolated_on_the_val_curve() -> None:
    curve = [(0, 4.0), (10, 3.0), (20, 2.0), (30, 1.5)]
    assert crossing(curve, 2.5) == pytest.approx(15.0)
    assert crossing(curve, 4.5) == 0.0 and crossing(curve, 1.0) is None
    assert crossing(curve, 2.0) == pytest.approx(20.0)
    series = {"val/loss": curve, "tokens": [(0, 0.0), (10, 640.0), (20, 1280.0), (30, 1920.0)]}
    got = to_target(series, {"steps": 30, "tokens": 1920, "wall_time_s": 60.0}, 2.5, flops_per_token=1e6)
    assert got == pytest.approx({"steps_to_target": 15.0, "tokens_to_target": 960.0, "flops_to_target": 9.6e8,
                                 "time_to_target_s": 30.0})
    no_tokens = to_target({"val/loss": curve}, {"steps": 30, "tokens": 3000}, 2.5, None)
    assert no_tokens["tokens_to_target"] == pytest.approx(1500.0) and no_tokens["flops_to_target"] is None


def _run(sweep: Path, overrides: list[str], best: float, val: list[tuple[int, float]]) -> None:
    run = sweep / ",".join(overrides)
    run.mkdir(parents=True)
    run.joinpath("summary.json").write_text(json.dumps({
        "status": "completed", "steps": val[-1][0], "tokens": 64 * val[-1][0], "overrides": overrides,
        "best_val_loss": best, "final_val_loss": best, "wall_time_s": 10.0, "flops_per_token": 1000}))
    rows = "".join(f"{s},{v},{64 * s}\n" for s, v in val)
    run.joinpath("metrics.csv").write_text("step,val/loss,tokens\n" + rows)


def test_compare_tests_each_variant_against_the_baseline(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    bests = {"mlp": [2.00, 2.10, 1.95], "swiglu": [1.90, 1.99, 1.86], "glu": [2.05, 2.06, 1.98]}
    for ffn, values in bests.items():
        for seed, best in zip("123", values):
            _run(sweep, [f"ffn={ffn}", f"seed={seed}"], best, [(0, 4.0), (10, 3.0), (20, best)])
    _, md = compare(sweep, baseline="ffn=mlp")
    with open(sweep / "compare_significance.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"ffn=glu", "ffn=swiglu"} and rows["ffn=glu"]["baseline"] == "ffn=mlp"
    swiglu = stats.ttest_rel(bests["swiglu"], bests["mlp"])
    glu = stats.ttest_rel(bests["glu"], bests["mlp"])
    assert float(rows["ffn=swiglu"]["p"]) == pytest.approx(swiglu.pvalue)
    low, high = sorted((swiglu.pvalue, glu.pvalue))
    holm_p = {swiglu.pvalue: 2 * low if swiglu.pvalue == low else max(2 * low, high)}
    assert float(rows["ffn=swiglu"]["p_holm"]) == pytest.approx(holm_p[swiglu.pvalue])
    assert rows["ffn=swiglu"]["distinguishable"].startswith("yes")  # -0.1 on every seed, ±0.01
    assert rows["ffn=glu"]["distinguishable"].startswith("no")
    assert "Paired against the baseline" in md
    with open(sweep / "compare.csv") as f:
        per_run = list(csv.DictReader(f))
    # target: the highest best val loss (2.10); mlp seed 2 reaches it at step 20, mlp seed 1 (2.0) at 10 + 9/10·10
    assert "Target val loss for *_to_target: 2.1" in md
    row = next(r for r in per_run if r["ffn"] == "mlp" and r["seed"] == "1")
    assert float(row["steps_to_target"]) == pytest.approx(19.0)
    assert float(row["flops_to_target"]) == pytest.approx(19.0 * 64 * 1000)
    assert float(row["time_to_target_s"]) == pytest.approx(10.0 * 19 / 20)
    with pytest.raises(ValueError, match="baseline='ffn=moe' must name exactly one variant"):
        compare(sweep, baseline="ffn=moe")


def test_the_baseline_is_named_by_value_or_by_key() -> None:
    from lmlab.analysis.compare_stats import pick_baseline

    names = ["ffn=mlp,norm=rms", "ffn=swiglu,norm=rms", "ffn=mlp,norm=layer"]
    assert pick_baseline(names, None) == names[0]
    assert pick_baseline(names, "mlp,layer") == pick_baseline(names, "ffn=mlp,norm=layer") == names[2]
    assert pick_baseline(names, ["swiglu"]) == names[1]  # a Hydra list
    with pytest.raises(ValueError, match=r"baseline='mlp' must name exactly one variant.*\(2 match\)"):
        pick_baseline(names, "mlp")


def test_two_sweeps_are_one_comparison_seeds_aggregated_and_paired_across_them(tmp_path: Path) -> None:
    """A baseline sweep and a new one, the same command (ffn=mlp, 2 seeds each): the sweep a run came from is its key,
    the variants table has one row per sweep (n=2, mean ± sd), the new one is paired against the baseline's seeds."""
    base, new = tmp_path / "runs" / "baseline", tmp_path / "runs" / "new"
    for sweep, values in ((base, [2.00, 2.10]), (new, [1.90, 2.02])):
        for seed, best in zip("12", values):
            _run(sweep, ["ffn=mlp", f"seed={seed}"], best, [(0, 4.0), (10, 3.0), (20, best)])
    rows, md = compare([base, new])
    out = base / "vs_new"
    assert [(r["sweep"], r["seed"], r["run"]) for r in rows] == [
        ("baseline", "1", "baseline/ffn=mlp,seed=1"), ("baseline", "2", "baseline/ffn=mlp,seed=2"),
        ("new", "1", "new/ffn=mlp,seed=1"), ("new", "2", "new/ffn=mlp,seed=2")]
    with open(out / "compare_variants.csv") as f:
        variants = {r["sweep"]: r for r in csv.DictReader(f)}
    assert variants["new"]["n"] == "2" and float(variants["new"]["best_val_loss_mean"]) == pytest.approx(1.96)
    assert float(variants["baseline"]["best_val_loss_sd"]) == pytest.approx(stats.tstd([2.00, 2.10]))
    half = stats.t.ppf(0.975, 1) * stats.tstd([1.90, 2.02]) / 2 ** 0.5  # the mean's 95% interval, n = 2
    assert float(variants["new"]["best_val_loss_ci95"]) == pytest.approx(half)
    with open(out / "compare_significance.csv") as f:
        (pair,) = csv.DictReader(f)
    assert pair["variant"] == "sweep=new" and pair["baseline"] == "sweep=baseline"
    assert float(pair["p"]) == pytest.approx(stats.ttest_rel([1.90, 2.02], [2.00, 2.10]).pvalue)
    assert (out / "compare.md").is_file() and not (base / "compare.md").exists()  # the sweeps' own files untouched
    assert md.count("| sweep ") >= 2  # the runs table and the variants table
