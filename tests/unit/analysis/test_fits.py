"""Scaling-law fits (lmlab.analysis.fits): known parameters recovered from synthetic curves, too few points refused, the
compute-equivalent multiplier and the crossover on fits whose answers are known in closed form."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lmlab.analysis.fits import PowerLaw, compute_multiplier, crossover, fit_power_law

C = np.logspace(12, 16, 5)  # five rungs, a decade apart


def test_the_fit_recovers_known_parameters_from_an_exact_curve() -> None:
    loss = 2.0 + 50.0 * C ** -0.3  # 3.26 .. 2.32
    fit = fit_power_law(C, loss)
    assert fit.n == 5 and fit.rmse < 1e-6
    assert fit.E == pytest.approx(2.0, rel=1e-4) and fit.alpha == pytest.approx(0.3, rel=1e-4)
    assert fit.A == pytest.approx(50.0, rel=1e-3)
    assert fit.loss(1e14) == pytest.approx(2.0 + 50.0 * 1e14 ** -0.3, rel=1e-6)


def test_with_noise_the_intervals_hold_the_true_parameters() -> None:
    rng = np.random.default_rng(0)
    c = np.logspace(10, 16, 8)
    loss = 1.5 + 30.0 * c ** -0.25 + rng.normal(0, 0.003, c.size)
    fit = fit_power_law(c, loss)
    for true, ci in ((1.5, fit.E_ci), (0.25, fit.alpha_ci), (30.0, fit.A_ci)):
        assert ci[0] < true < ci[1], (true, ci)
    assert fit.alpha == pytest.approx(0.25, abs=0.05) and fit.E == pytest.approx(1.5, abs=0.05)


def test_too_few_points_are_refused_and_three_have_no_interval() -> None:
    with pytest.raises(ValueError, match="3 parameters and needs at least 3 points .*got 2"):
        fit_power_law([1e12, 1e13], [3.0, 2.8])
    with pytest.raises(ValueError, match="got 2"):  # a diverged rung (nan) is not a point
        fit_power_law([1e12, 1e13, 1e14], [3.0, float("nan"), 2.7])
    three = fit_power_law(C[:3], 2.0 + 50.0 * C[:3] ** -0.3)
    assert three.E_ci is None and three.alpha == pytest.approx(0.3, rel=1e-3)


def test_runs_at_one_compute_are_not_a_ladder_over_compute() -> None:
    """experiment=depth_width: five shapes at one budget.flops, spent to within a step's rounding: no L(C)."""
    spent = [4.996e12, 4.998e12, 4.999e12, 4.998e12, 4.996e12]
    with pytest.raises(ValueError, match=r"span 1\.00× of compute.*at least 2×"):
        fit_power_law(spent, [1.736, 1.774, 1.827, 1.975, 2.086])
    assert fit_power_law([1e12, 1.5e12, 2e12], [3.0, 2.9, 2.85]).n == 3  # 2× is enough to be fitted


def test_compute_multiplier_on_synthetic_fits() -> None:
    base = PowerLaw(E=2.0, A=50.0, alpha=0.3, n=5, rmse=0.0)
    # A_v = A_b·k^α: the variant at C equals the baseline at C/k, so it needs k× the compute for any loss
    better = PowerLaw(E=2.0, A=50.0 * 0.8 ** 0.3, alpha=0.3, n=5, rmse=0.0)
    for c in (1e12, 1e15):
        assert compute_multiplier(better, base, c) == pytest.approx(0.8, rel=1e-9)
        assert compute_multiplier(base, better, c) == pytest.approx(1.25, rel=1e-9)
    floor = PowerLaw(E=2.5, A=1.0, alpha=0.3, n=5, rmse=0.0)  # never gets below 2.5
    assert compute_multiplier(floor, base, 1e16) == math.inf  # the baseline's 2.08 there is out of its reach


def test_crossover_on_synthetic_fits() -> None:
    base = PowerLaw(E=2.0, A=50.0, alpha=0.3, n=5, rmse=0.0)
    lower_floor = PowerLaw(E=1.9, A=80.0, alpha=0.3, n=5, rmse=0.0)  # worse small, better large
    # 1.9 + 80·C^-0.3 = 2 + 50·C^-0.3  <=>  C = 300^(1/0.3)
    (root,) = crossover(lower_floor, base, 1e6, 1e12)
    assert root == pytest.approx(300 ** (1 / 0.3), rel=1e-6)
    assert lower_floor.loss(root / 10) > base.loss(root / 10) and lower_floor.loss(root * 10) < base.loss(root * 10)
    parallel = PowerLaw(E=2.0, A=40.0, alpha=0.3, n=5, rmse=0.0)
    assert crossover(parallel, base, 1e6, 1e12) == []


def test_the_band_holds_the_true_curve_and_narrows_inside_the_points() -> None:
    rng = np.random.default_rng(1)
    c = np.logspace(10, 16, 8)
    fit = fit_power_law(c, 1.5 + 30.0 * c ** -0.25 + rng.normal(0, 0.003, c.size))
    low, high = fit.band(c)
    true = 1.5 + 30.0 * c ** -0.25
    assert np.all(low < fit.loss(c)) and np.all(fit.loss(c) < high)
    assert np.mean((low < true) & (true < high)) >= 0.75
    far_low, far_high = fit.band(np.array([1e7]))  # extrapolating three decades down: wider than anywhere inside
    assert (far_high - far_low)[0] > np.max(high - low)
    assert fit_power_law(C[:3], 2.0 + 50.0 * C[:3] ** -0.3).band(C) is None


def _ladder_run(sweep, overrides, compute, loss):
    import json

    run = sweep / ",".join(overrides)
    run.mkdir(parents=True)
    run.joinpath("summary.json").write_text(json.dumps({
        "status": "completed", "steps": 10, "tokens": 100, "overrides": overrides, "final_val_loss": loss,
        "best_val_loss": loss, "budget_spent": {"flops": compute, "tokens": 100}}))


def test_a_ladder_nothing_can_be_fitted_on_draws_no_empty_plot(tmp_path) -> None:
    """Two sizes per variant (a fit needs 3): the table says why per variant, and no empty loss-vs-compute plot."""
    import csv

    from lmlab.analysis.compare import compare

    sweep = tmp_path / "ladder"
    for ffn in ("mlp", "swiglu"):
        for d, c in (("32", 1e12), ("64", 1e13)):
            _ladder_run(sweep, [f"ffn={ffn}", f"model.d_model={d}"], c, 3.0)
    _, md = compare(sweep)
    with open(sweep / "compare_ladder.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert all("needs at least 3 points" in r["problem"] for r in rows.values()) and len(rows) == 2
    assert not (sweep / "plots" / "loss_vs_compute.png").exists()
    assert "Scaling fits L(C) = E + A·C^(−α): none" in md


def test_compare_fits_a_ladder_per_variant(tmp_path) -> None:
    import csv

    from lmlab.analysis.compare import compare

    sweep = tmp_path / "ladder"
    sizes = {"32": 1e12, "64": 1e13, "96": 1e14, "128": 1e15, "160": 1e16}
    # swiglu = mlp at 0.8x the compute: A_v = A_b·0.8^α; reglu has two sizes only
    laws = {"mlp": (2.0, 50.0, 0.3), "swiglu": (2.0, 50.0 * 0.8 ** 0.3, 0.3)}
    for ffn, (e, a, alpha) in laws.items():
        for d, c in sizes.items():
            for seed, noise in (("1", 0.0), ("2", 1e-4)):
                _ladder_run(sweep, [f"ffn={ffn}", f"model.d_model={d}", f"seed={seed}"], c,
                            e + a * c ** -alpha + noise)
    for d in ("32", "64"):
        _ladder_run(sweep, ["ffn=reglu", f"model.d_model={d}", "seed=1"], sizes[d], 3.0)
    _, md = compare(sweep, baseline="ffn=mlp")
    with open(sweep / "compare_ladder.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert float(rows["ffn=mlp"]["alpha"]) == pytest.approx(0.3, rel=0.01)
    assert float(rows["ffn=mlp"]["E"]) == pytest.approx(2.0, rel=0.01)
    assert float(rows["ffn=swiglu"]["multiplier_at_max_C"]) == pytest.approx(0.8, rel=0.02)
    assert rows["ffn=swiglu"]["crossover_C"] == "none"
    assert "needs at least 3 points" in rows["ffn=reglu"]["problem"] and rows["ffn=reglu"]["E"] == ""
    assert (sweep / "plots" / "loss_vs_compute.png").stat().st_size > 5000
    assert "Scaling fits" in md
    with open(sweep / "compare_significance.csv") as f:  # seeds paired within each size, against mlp at that size
        sig = {r["variant"]: r for r in csv.DictReader(f)}
    assert "ffn=swiglu,model.d_model=64" in sig and sig["ffn=swiglu,model.d_model=64"]["baseline"] == "ffn=mlp"
    assert float(sig["ffn=swiglu,model.d_model=64"]["diff_mean"]) < 0  # the better variant: lower loss


def test_a_fit_through_few_scattered_points_has_wide_but_finite_numbers() -> None:
    """Four rungs that barely follow the law (a real tiny ladder): the fit still returns, its A interval may be
    unbounded above (inf, not an overflow)."""
    c = [3.5e11, 1.8e12, 5.6e12, 2.9e13]
    fit = fit_power_law(c, [2.69, 2.36, 2.03, 2.05])
    assert math.isfinite(fit.E) and fit.A_ci is not None and fit.A_ci[0] <= fit.A <= fit.A_ci[1]


# --- L(N, D) = E + A/N^α + B/D^β (Hoffmann et al., 2022) ---------------------------------------------------------

CHINCHILLA = {"E": 1.69, "A": 406.4, "alpha": 0.34, "B": 410.7, "beta": 0.28}  # their fitted law (their Eq. 10)


def _grid(ns=(1e6, 3e6, 1e7, 3e7, 1e8), per_param=(5, 20, 80)):
    """A ladder that varies both: every size N at several tokens per parameter D/N."""
    n = np.array([x for x in ns for _ in per_param], dtype=float)
    d = np.array([x * k for x in ns for k in per_param], dtype=float)
    return n, d


def _chinchilla(n, d, p=CHINCHILLA):
    return p["E"] + p["A"] * n ** -p["alpha"] + p["B"] * d ** -p["beta"]


def test_the_nd_fit_recovers_known_parameters_from_an_exact_surface() -> None:
    from lmlab.analysis.fits import fit_chinchilla

    n, d = _grid()
    fit = fit_chinchilla(n, d, _chinchilla(n, d))
    assert fit.n == 15 and fit.rmse < 1e-6
    for key, true in CHINCHILLA.items():
        assert getattr(fit, key) == pytest.approx(true, rel=1e-6), key
    assert fit.loss(5e7, 1e9) == pytest.approx(_chinchilla(5e7, 1e9), rel=1e-6)
    # the compute-optimal split under C = 6·N·D: N_opt ∝ C^(β/(α+β)), D_opt ∝ C^(α/(α+β))
    assert fit.n_opt_exponent == pytest.approx(0.28 / 0.62, rel=1e-6)


def test_with_noise_the_nd_intervals_hold_the_true_parameters() -> None:
    from lmlab.analysis.fits import fit_chinchilla

    rng = np.random.default_rng(0)
    n, d = _grid(ns=np.logspace(6, 9, 7), per_param=(2, 8, 32, 128))  # 28 runs over 3 decades of N, 4.5 of D
    fit = fit_chinchilla(n, d, _chinchilla(n, d) + rng.normal(0, 0.002, n.size))
    for key, true in CHINCHILLA.items():
        low, high = getattr(fit, f"{key}_ci")
        assert low < true < high, (key, true, low, high)
    assert fit.alpha == pytest.approx(0.34, abs=0.05) and fit.beta == pytest.approx(0.28, abs=0.05)
    assert fit.E == pytest.approx(1.69, abs=0.1)


def test_the_nd_fit_refuses_a_ladder_that_does_not_vary_both() -> None:
    from lmlab.analysis.fits import fit_chinchilla

    n = np.logspace(6, 8, 6)
    # fixed tokens per parameter (experiment=ladder's budget.tokens_per_param): D ∝ N, to the rounding of a step
    d = np.floor(10 * n / 1024) * 1024
    with pytest.raises(ValueError, match=r"varies both N and D.*D ∝ N\^1\.00"):
        fit_chinchilla(n, d, _chinchilla(n, d))
    with pytest.raises(ValueError, match=r"D ∝ N\^-1\.00 .*one compute budget"):  # depth_width: one budget.flops
        fit_chinchilla(n, 5e12 / (6 * n), _chinchilla(n, 5e12 / (6 * n)))
    with pytest.raises(ValueError, match="varies both N and D"):  # one size, several token counts: no N to fit α on
        fit_chinchilla(np.full(6, 1e7), np.logspace(8, 10, 6), _chinchilla(np.full(6, 1e7), np.logspace(8, 10, 6)))
    with pytest.raises(ValueError, match="5 parameters and needs at least 5 points .*got 4"):
        n4, d4 = np.array([1e6, 1e6, 1e7, 1e7]), np.array([1e7, 1e8, 1e8, 1e9])
        fit_chinchilla(n4, d4, _chinchilla(n4, d4))
    n, d = _grid(ns=(1e6, 1e7), per_param=(5, 20, 80))  # 6 points that vary both: fitted
    assert fit_chinchilla(n, d, _chinchilla(n, d)).n == 6
    five_n, five_d = n[:5], d[:5]  # exactly 5: through the points, no interval
    five = fit_chinchilla(five_n, five_d, _chinchilla(five_n, five_d))
    assert five.E_ci is None and five.alpha_ci is None


def _nd_run(sweep, overrides, n, d, loss):
    import json

    run = sweep / ",".join(overrides)
    run.mkdir(parents=True)
    run.joinpath("summary.json").write_text(json.dumps({
        "status": "completed", "steps": 10, "tokens": int(d), "overrides": overrides, "final_val_loss": loss,
        "best_val_loss": loss, "budget": {"kind": "tokens_per_param", "n_matmul": int(n)},
        "budget_spent": {"flops": 6 * n * d, "tokens": int(d)}}))


def test_compare_fits_l_of_n_and_d_where_the_ladder_varies_both(tmp_path) -> None:
    import csv

    from lmlab.analysis.compare import compare

    sweep = tmp_path / "nd"
    widths = {"32": 3e4, "64": 1e5, "96": 2.5e5, "128": 4e5, "192": 1e6}  # N: matmul weights of each rung
    swiglu = {**CHINCHILLA, "B": 300.0, "beta": 0.3}
    for ffn, law in (("mlp", CHINCHILLA), ("swiglu", swiglu)):
        for width, n in widths.items():
            for k in (5, 20, 80):  # budget.tokens_per_param: D = k·N
                _nd_run(sweep, [f"budget.tokens_per_param={k}", f"ffn={ffn}", f"model.d_model={width}"], n, k * n,
                        float(_chinchilla(n, k * n, law)))
    _, md = compare(sweep, baseline="ffn=mlp")
    with open(sweep / "compare_ladder_nd.csv") as f:
        rows = {r["variant"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"ffn=mlp", "ffn=swiglu"}  # tokens per parameter is the ladder's, not a variant
    for name, law in (("ffn=mlp", CHINCHILLA), ("ffn=swiglu", swiglu)):
        assert int(rows[name]["points"]) == 15
        for key, true in law.items():
            assert float(rows[name][key]) == pytest.approx(true, rel=1e-3), (name, key)
        assert float(rows[name]["n_opt_exponent"]) == pytest.approx(law["beta"] / (law["alpha"] + law["beta"]),
                                                                    rel=1e-3)
        low, high = (float(v) for v in rows[name]["alpha_ci95"].strip("[]").split(","))
        assert low <= law["alpha"] <= high
    assert "L(N, D) = E + A/N^α + B/D^β" in md
    with open(sweep / "compare_ladder.csv") as f:  # L(C) over the same runs: one fit per variant, every point
        assert {r["variant"]: int(r["points"]) for r in csv.DictReader(f)} == {"ffn=mlp": 15, "ffn=swiglu": 15}


def test_compare_says_why_a_fixed_tokens_per_parameter_ladder_has_no_nd_fit(tmp_path) -> None:
    from lmlab.analysis.compare import compare

    sweep = tmp_path / "ladder"
    for width, n in {"32": 3e4, "64": 1e5, "96": 2.5e5, "128": 4e5, "192": 1e6}.items():
        _nd_run(sweep, ["ffn=mlp", f"model.d_model={width}"], n, 10 * n, float(_chinchilla(n, 10 * n)))
    _, md = compare(sweep)
    assert "Scaling fits L(C)" in md
    assert "L(N, D) not fitted: an L(N, D) fit needs a ladder that varies both N and D" in md
    assert "D ∝ N^1.00" in md and not (sweep / "compare_ladder_nd.csv").exists()
