"""Noise floors per metric (lmlab.analysis.compare_noise) and the exact seed count (lmlab.analysis.significance)."""

from __future__ import annotations

import csv
import json
import math
import statistics
from pathlib import Path

import pytest
from scipy import integrate, stats

from lmlab.analysis.compare import compare
from lmlab.analysis.significance import seeds_needed, seeds_needed_exact, t_power
from lmlab.commands import main

OFFSETS = [0.02, -0.01, 0.01, -0.02, 0.0]  # the last 5 validations around the final value: sd √2.5 · 0.01
TASK = "downstream/hellaswag/acc"


def _run(sweep: Path, overrides: list[str], final: float, scale: float = 1.0, bpb: float | None = None,
         acc: float | None = None) -> None:
    """A finished run whose val curve ends in final + scale·OFFSETS (and bpb, a downstream score, when given)."""
    run = sweep / ",".join(overrides)
    run.mkdir(parents=True)
    steps = list(range(0, 80, 10))
    losses = [4.0, 3.5, 3.0] + [final + scale * o for o in OFFSETS]
    summary = {"status": "completed", "steps": 70, "tokens": 64 * 70, "overrides": overrides, "best_val_loss": final,
               "final_val_loss": final, "wall_time_s": 10.0, "flops_per_token": 1000}
    cols = ["step", "val/loss"]
    rows = [[s, v] for s, v in zip(steps, losses)]
    if bpb is not None:
        summary |= {"final_val_bpb": bpb, "best_val_bpb": bpb}
        cols.append("val/bpb")
        for row, v in zip(rows, [3.0, 2.5, 2.0] + [bpb + 2 * scale * o for o in OFFSETS]):
            row.append(v)
    if acc is not None:
        summary["downstream"] = {"step": 70, "metrics": {TASK: acc}}
        cols.append(TASK)
        for row, v in zip(rows, [0.25, 0.26, 0.27] + [acc + scale * o for o in OFFSETS]):
            row.append(v)
    run.joinpath("summary.json").write_text(json.dumps(summary))
    run.joinpath("metrics.csv").write_text(",".join(cols) + "\n" + "".join(",".join(map(str, r)) + "\n" for r in rows))


def _rows(sweep: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(sweep / "compare_noise.csv") as f:
        return {(r["metric"], r["variant"]): r for r in csv.DictReader(f)}


STEP_SD = statistics.stdev(OFFSETS)  # = √2.5 · 0.01


def test_seed_and_step_floors_and_snr_by_hand(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    finals = {"mlp": [2.00, 2.10, 1.90], "swiglu": [1.50, 1.60, 1.40], "glu": [1.98, 2.08, 1.88]}
    accs = {"mlp": [0.30, 0.32, 0.28], "swiglu": [0.40, 0.41, 0.39], "glu": [0.30, 0.30, 0.30]}
    scales = {"mlp": 1.0, "swiglu": 2.0, "glu": 1.0}
    for ffn, values in finals.items():
        for seed, final, acc in zip("123", values, accs[ffn]):
            _run(sweep, [f"ffn={ffn}", f"seed={seed}"], final, scales[ffn], acc=acc)
    _, md = compare(sweep, baseline="ffn=mlp")
    rows = _rows(sweep)
    assert "Noise floors per metric" in md
    base, sw, glu = (rows[("final_val_loss", f"ffn={v}")] for v in ("mlp", "swiglu", "glu"))
    # seed spread: sd of the three finals, 0.1 for each; step-to-step: sd of the last 5 validations (scaled offsets)
    assert float(base["seed_sd"]) == pytest.approx(0.1) and float(sw["seed_sd"]) == pytest.approx(0.1)
    assert float(base["step_sd"]) == pytest.approx(STEP_SD) and float(sw["step_sd"]) == pytest.approx(2 * STEP_SD)
    assert base["diff"] == "" and base["below_floor"] == ""  # the baseline is not compared with itself
    # swiglu − mlp = −0.5 over the pooled seed sd √((0.1² + 0.1²)/2) = 0.1: SNR 5, above 2 floors
    assert float(sw["diff"]) == pytest.approx(-0.5) and float(sw["floor"]) == pytest.approx(0.1)
    assert sw["floor_from"] == "seeds" and float(sw["snr"]) == pytest.approx(5.0) and sw["below_floor"] == "False"
    assert int(sw["seeds_needed"]) == seeds_needed_exact(5.0, paired=False)
    # glu − mlp = −0.02: SNR 0.2, below the floor (|Δ| < 2 · floor)
    assert float(glu["snr"]) == pytest.approx(0.2) and glu["below_floor"] == "True"
    assert int(glu["seeds_needed"]) == seeds_needed_exact(0.2, paired=False) == 394
    # a downstream task is a metric of its own: its seed sds (0.02, 0.01) pooled √((0.02² + 0.01²)/2)
    acc = rows[(TASK, "ffn=swiglu")]
    floor = math.sqrt((0.02 ** 2 + 0.01 ** 2) / 2)
    assert float(acc["seed_sd"]) == pytest.approx(0.01) and float(acc["floor"]) == pytest.approx(floor)
    assert float(acc["snr"]) == pytest.approx(0.1 / floor) and acc["below_floor"] == "False"
    zero = rows[(TASK, "ffn=glu")]  # the same score on every seed: an sd of 0 pooled with mlp's 0.02
    assert float(zero["seed_sd"]) == 0.0 and float(zero["floor"]) == pytest.approx(0.02 / math.sqrt(2))
    assert zero["below_floor"] == "True"  # Δ = 0
    assert ("final_val_bpb", "ffn=mlp") not in rows  # no run has bits per byte


def test_one_seed_falls_back_to_the_step_to_step_floor(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _run(sweep, ["norm=rms"], 2.00, 1.0, bpb=1.20)
    _run(sweep, ["norm=layer"], 1.99, 3.0, bpb=1.00)
    compare(sweep, baseline="rms")
    rows = _rows(sweep)
    loss = rows[("final_val_loss", "norm=layer")]
    floor = math.sqrt((STEP_SD ** 2 + (3 * STEP_SD) ** 2) / 2)  # pooled step-to-step sds of the two runs
    assert loss["seed_sd"] == "" and loss["floor_from"] == "steps"
    assert float(loss["floor"]) == pytest.approx(floor)
    assert float(loss["snr"]) == pytest.approx(0.01 / floor) and loss["below_floor"] == "True"
    bpb = rows[("final_val_bpb", "norm=layer")]  # bpb's own curve: offsets twice as wide
    assert float(bpb["step_sd"]) == pytest.approx(6 * STEP_SD)
    assert float(bpb["floor"]) == pytest.approx(2 * floor) and bpb["below_floor"] == "False"  # 0.2 / 0.0707 = 2.8 > 2


def test_last_k_by_hand() -> None:
    from lmlab.analysis.compare_noise import step_sd

    curve = [(s, v) for s, v in enumerate([9.0, 9.0, 1.0, 2.0, 3.0, 4.0, 5.0])]
    assert step_sd(curve) == pytest.approx(statistics.stdev([1, 2, 3, 4, 5]))
    assert step_sd(curve, k=3) == pytest.approx(1.0)
    assert step_sd(curve[:1]) is None  # one validation: no step-to-step spread


def _power_by_integration(n: int, d: float, paired: bool, alpha: float = 0.05) -> float:
    """The t test's power written out: T = (Z + δ)/(X/√ν), X ~ χ_ν, so P(|T| > c) = ∫ [Φ(δ − c·x/√ν) +
    Φ(−δ − c·x/√ν)] f_χν(x) dx, integrated numerically (independent of scipy's noncentral t)."""
    df = n - 1 if paired else 2 * n - 2
    delta = d * math.sqrt(n if paired else n / 2)
    c = stats.t.ppf(1 - alpha / 2, df)

    def f(x: float) -> float:
        s = c * x / math.sqrt(df)
        return (stats.norm.cdf(delta - s) + stats.norm.cdf(-delta - s)) * stats.chi.pdf(x, df)

    return integrate.quad(f, stats.chi.ppf(1e-15, df), stats.chi.isf(1e-15, df), limit=200)[0]  # where X lies


@pytest.mark.parametrize("d, paired, n", [(1.0, False, 17), (0.5, False, 64), (0.8, False, 26), (0.5, True, 34),
                                          (1.0, True, 10), (0.2, False, 394)])
def test_exact_seeds_against_published_values(d: float, paired: bool, n: int) -> None:
    # Cohen (1988) Table 2.4.1 and G*Power: two-sample d = 1.0 → 17 per group, 0.5 → 64, 0.8 → 26; matched pairs
    # d = 0.5 → 34 (G*Power's actual power 0.8077775)
    assert seeds_needed_exact(d, paired=paired) == n
    assert t_power(n, d, paired=paired) >= 0.8 > t_power(n - 1, d, paired=paired)
    for m in (n - 1, n):
        assert t_power(m, d, paired=paired) == pytest.approx(_power_by_integration(m, d, paired), abs=1e-7)
    if (d, paired) == (0.5, True):
        assert t_power(34, 0.5, paired=True) == pytest.approx(0.8077775, abs=1e-6)


def test_the_normal_approximation_gives_other_counts() -> None:
    z = stats.norm.ppf(0.975) + stats.norm.ppf(0.8)
    normal = lambda d, k: math.ceil(k * (z / d) ** 2)  # noqa: E731  n = k·((z_{1−α/2} + z_{1−β})/d)²
    assert normal(1.0, 2) == 16 != seeds_needed_exact(1.0, paired=False) == 17
    assert normal(1.0, 1) == 8 != seeds_needed_exact(1.0, paired=True) == 10
    assert normal(2.0, 1) == 2 != seeds_needed_exact(2.0, paired=True) == 5


def test_paired_seed_advice_is_exact() -> None:
    # seeds_needed(mean, sd): the paired test's count at d = |mean|/sd, now from the noncentral t (signature kept)
    assert seeds_needed(0.01, 0.01) == 10 and seeds_needed(-0.01, 0.005) == seeds_needed_exact(2.0, paired=True) == 5
    assert seeds_needed(0.01, 0.02) == 34 and seeds_needed(0.0, 0.01) == 1001 and seeds_needed(0.1, None) is None
    assert seeds_needed(0.001, 0.1) == 1001  # d = 0.01 needs ~78,000: past MAX_SEEDS


def test_lmlab_compare_seeds_needed(capsys: pytest.CaptureFixture[str]) -> None:
    main(["compare", "--seeds-needed=0.5"])
    out = capsys.readouterr().out
    assert "34 paired seeds" in out and "64 seeds per variant" in out
    main(["compare", "--seeds-needed", "1"])
    out = capsys.readouterr().out
    assert "10 paired seeds" in out and "17 seeds per variant" in out
    for bad in ("--seeds-needed=-0", "--seeds-needed=x", "--seeds-needed"):
        with pytest.raises(SystemExit) as stop:
            main(["compare", bad])
        assert stop.value.code == 2 and "the effect d" in capsys.readouterr().err


def test_power_where_scipy_loses_the_far_tail() -> None:
    from lmlab.analysis.significance import _tail

    for df, nc in ((1, 3.0), (5, 2.0), (200, 1.5)):  # the integral against scipy where scipy has it
        c = stats.t.ppf(0.975, df)
        assert _tail(c, df, -nc) == pytest.approx(stats.nct.cdf(-c, df, nc), rel=1e-8)
        assert _tail(c, df, nc) == pytest.approx(stats.nct.sf(c, df, nc), rel=1e-8)
    c = stats.t.ppf(0.975, 498)
    assert math.isnan(stats.nct.cdf(-c, 498, math.sqrt(125)))  # scipy 1.17: nan 11 sd out
    assert t_power(250, 1.0, paired=False) == pytest.approx(1.0, abs=1e-9) and seeds_needed_exact(0.01) == 1001
    assert math.isnan(stats.nct.sf(c, 999, 1e9 * math.sqrt(1000)))  # and nan where the power is 1
    assert t_power(1000, 1e9) == pytest.approx(1.0) and seeds_needed(1.0, 1e-9) == 2
