"""The optimizer benchmark's readout (lmlab/analysis/optimizer_benchmark.py) on runs written out by hand: the lr each
arm is tuned to (on the tune half, a failed seed disqualifying its lr), the paired verdict at p < 0.01 and its steps
at the measured end slope, the default target and the steps to it."""

from __future__ import annotations

import math
import statistics

import pytest
from scipy import stats

from lmlab.analysis.optimizer_benchmark import Arm, Run, report, verdict, verdict_line


def _curve(end: float, slope: float) -> list[tuple[int, float]]:
    """A val curve of 4 points 100 steps apart ending at `end`, falling `slope` per step."""
    return [(s, end + slope * (300 - s)) for s in (0, 100, 200, 300)]


def _arm(optim: str, tests: dict[str, dict[str, float]], tunes: dict[str, float] | None = None, slope: float = 1e-3,
         failed: tuple[tuple[str, str], ...] = ()) -> Arm:
    """An arm whose run at (lr, seed) has test loss tests[lr][seed], tune loss tunes[lr] + its test's offset from
    the lr's first seed, and the val curve ending at its test loss."""
    arm = Arm(optim, "model.d_model=64")
    for lr, seeds in tests.items():
        base = next(iter(seeds.values()))
        for seed, test in seeds.items():
            tune = (tunes or {}).get(lr, test) + (test - base)
            arm.runs.setdefault(lr, {})[seed] = Run(seed, lr, (lr, seed) not in failed, tune, test, _curve(test, slope))
    return arm


def test_each_arm_takes_the_lr_with_the_lowest_mean_tune_loss_and_a_failed_seed_disqualifies_its_lr() -> None:
    arm = _arm("adamw", {"1e-3": {"0": 2.0, "1": 2.1}, "3e-3": {"0": 1.9, "1": 1.95}, "1e-2": {"0": 1.5, "1": 1.6}},
               tunes={"1e-3": 2.0, "3e-3": 1.8, "1e-2": 1.5})
    assert arm.lr == "1e-2" and arm.at_edge  # the grid's edge: widen it
    failed = _arm("adamw", {"1e-3": {"0": 2.0, "1": 2.1}, "3e-3": {"0": 1.9, "1": 1.95}, "1e-2": {"0": 1.5, "1": 1.6}},
                  tunes={"1e-3": 2.0, "3e-3": 1.8, "1e-2": 1.5}, failed=(("1e-2", "1"),))
    assert failed.tuning()["1e-2"] == math.inf and failed.lr == "3e-3" and not failed.at_edge
    assert failed.finals() == {"0": 1.9, "1": 1.95}
    # chosen on the tune half, not the test half: a lr whose test losses are lower but tune losses higher loses
    picky = _arm("lion", {"1e-3": {"0": 1.5, "1": 1.5}, "3e-3": {"0": 1.6, "1": 1.6}}, tunes={"1e-3": 2.0, "3e-3": 1.7})
    assert picky.lr == "3e-3"


def test_the_verdict_is_the_optimizer_tracks_rule_with_sigma_and_slope_from_these_runs() -> None:
    """(L_b − L_a + slope·(steps_b − steps_a)) / √(1/n_a + 1/n_b) against 2.326·σ, σ the pooled sd, worked by hand."""
    base = _arm("adamw", {"3e-3": {"0": 2.00, "1": 2.10, "2": 1.95, "3": 2.05}}, slope=2e-4)
    muon = _arm("muon", {"3e-3": {s: v - 0.2 - 0.01 * i for i, (s, v) in enumerate(base.finals().items())}},
                slope=4e-4)
    v = verdict(muon, base)
    fa, fb = list(muon.finals().values()), list(base.finals().values())
    sigma = math.sqrt((3 * statistics.variance(fa) + 3 * statistics.variance(fb)) / 6)
    gap = statistics.mean(fb) - statistics.mean(fa)  # 0.215: muon lower
    assert v["sigma"] == pytest.approx(sigma) and v["diff"] == pytest.approx(gap)
    assert v["lhs"] == pytest.approx(gap / math.sqrt(1 / 4 + 1 / 4)) and v["threshold"] == pytest.approx(2.326 * sigma)
    assert v["verdict"] == "better" and v["n"] == (4, 4) and v["p"] == pytest.approx(stats.norm.sf(v["lhs"] / sigma))
    slope = (2e-4 + 4e-4) / 2  # each arm's (v[-2] − v[-1]) / 100, averaged
    assert v["slope"] == pytest.approx(slope) and v["steps"] == pytest.approx(gap / slope)
    d = [a - b for a, b in zip(fa, fb)]  # the paired t test beside it
    assert v["paired_p"] == pytest.approx(2 * stats.t.sf(abs(statistics.mean(d) / (statistics.stdev(d) / 2)), 3))
    line = verdict_line(v)
    assert line.startswith("muon vs adamw (model.d_model=64): better (by +0.2150 in final test loss, ≈ +717 steps")
    assert "n=4, 4 seeds" in line and "2.326σ" in line
    assert verdict(base, muon)["verdict"] == "worse"
    # a gap of 0.02 with seed noise of ~0.06: not resolved; with the same noise and 0.2: resolved
    noisy = _arm("lion", {"3e-3": {s: base.finals()[s] - 0.02 + g for s, g in zip("0123", (0.08, -0.08, 0.0, 0.0))}})
    assert verdict(noisy, base)["verdict"] == "not resolved"
    # fewer steps to the same loss count for the arm that took them: the track's step term
    short = _arm("soap", {"3e-3": dict(base.finals())}, slope=2e-4)
    for run in short.tuned.values():
        run.curve = [(s - 100, v) for s, v in run.curve]  # the same losses, 100 steps sooner
    sv = verdict(short, base)
    assert sv["diff"] == pytest.approx(0.0) and sv["lhs"] == pytest.approx(100 * 2e-4 / math.sqrt(0.5))
    one = _arm("soap", {"3e-3": {"0": 1.0}})
    assert verdict(one, _arm("x", {"3e-3": {"0": 1.0}}))["verdict"] == "no test (n=1, 1)"


def test_the_report_targets_the_slowest_arms_final_loss_and_counts_steps_to_it() -> None:
    adamw = _arm("adamw", {"3e-3": {"0": 2.0, "1": 2.0}}, slope=1e-3)
    muon = _arm("muon", {"3e-3": {"0": 1.7, "1": 1.7}}, slope=1e-3)
    md, rows, pairs = report([adamw, muon])
    assert [r["target"] for r in rows] == [2.0, 2.0]  # the highest mean final val loss, rounded up to 0.001
    # adamw reaches 2.0 at its last step; muon's curve 1.7 + 1e-3·(300 − s) crosses 2.0 at step 0
    assert rows[0]["steps_mean"] == pytest.approx(300) and rows[1]["steps_mean"] == pytest.approx(0)
    assert rows[1]["relative_steps"] == pytest.approx(0.0) and rows[0]["relative_steps"] == 1.0
    assert len(pairs) == 1 and pairs[0]["a"] == "muon" and pairs[0]["b"] == "adamw"
    assert "| model.d_model=64 | muon | 3e-3 | 1.700 ± 0.000 |" in md and "target val loss | 2.0 |" in md
