"""compare's ladder section: a sweep whose runs differ in model size (a `model=` option or `model.*` keys) or budget
(`budget.*`) besides the variant's own keys gets one scaling-law fit per variant (lmlab.analysis.fits) over its runs'
(compute, final val loss), and, where the ladder varies both N and D, one L(N, D) fit per variant.

compare_ladder.{md,csv}: per variant the points, E, A, α with 95% intervals, the fit's rmse, the compute-equivalent
multiplier against the baseline variant at the largest compute the baseline reached (and at the smallest), and the
computes where the two fits cross inside [C_min/1e6, C_max·1e6]; plots/loss_vs_compute.png draws the points, fits
and bands. Compute is what the run spent: summary.json's budget_spent.flops, else its tokens × train FLOPs per token.
A variant with fewer points than the fit's parameters has no fit and says so.

compare_ladder_nd.{md,csv}: per variant L(N, D) = E + A/N^α + B/D^β with 95% intervals, the rmse and the exponent a
of the compute-optimal size N_opt ∝ C^a it implies; N is the run's matmul weights (the 6·N count's, summary.json's
budget.n_matmul or the rebuilt model's), D its training tokens. A ladder that does not vary both (fixed tokens per
parameter: D ∝ N) gets one line that says why there is no such fit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmlab.analysis.compare_stats import pick_baseline, variant_name
from lmlab.analysis.fits import compute_multiplier, crossover, fit_chinchilla, fit_power_law
from lmlab.analysis.sections import Sweep, section
from lmlab.record.plots import plot_loss_vs_compute
from lmlab.record.tables import fmt, write_table

COLS = ("variant", "points", "E", "E_ci95", "A", "alpha", "alpha_ci95", "rmse", "multiplier_at_max_C",
        "multiplier_at_min_C", "crossover_C", "problem")
ND_COLS = ("variant", "points", "E", "E_ci95", "A", "A_ci95", "alpha", "alpha_ci95", "B", "B_ci95", "beta",
           "beta_ci95", "rmse", "n_opt_exponent", "problem")


def size_keys(keys: Sequence[str]) -> list[str]:
    """The keys that set a rung of the ladder: the model's size (the `model` group and its `model.*` values) and the
    training budget (`budget.*`: the tokens per parameter of an N×D grid, a ladder of compute budgets)."""
    return [k for k in keys if k == "model" or k.startswith(("model.", "budget."))]


def compute_spent(summary: dict[str, Any], flops_per_token: float | None) -> float | None:
    spent = (summary.get("budget_spent") or {}).get("flops")
    if spent:
        return float(spent)
    tokens = summary.get("tokens")
    return float(tokens) * flops_per_token if tokens and flops_per_token else None


def _ci(ci: tuple[float, float] | None) -> str:
    return "" if ci is None else f"[{fmt(ci[0])}, {fmt(ci[1])}]"


def matmul_weights(summary: dict[str, Any]) -> int | None:
    """N of the run's 6·N count, as its budget recorded it (None without: compare rebuilds the model)."""
    n = (summary.get("budget") or {}).get("n_matmul")
    return int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0 else None


def _finished(row: dict[str, Any]) -> float | None:
    loss = row.get("final_val_loss")
    ok = row.get("status") == "completed" and isinstance(loss, (int, float)) and math.isfinite(loss)
    return float(loss) if ok else None


def nd_section(rows: Sequence[dict[str, Any]], n_and_d: Sequence[tuple[float | None, float | None]],
               keys: Sequence[str], sweep_dir: Path) -> str:
    """The L(N, D) fits' markdown (writes compare_ladder_nd.*), or one line saying why there are none. `n_and_d`:
    each run's (N, D); `keys`: the variant's keys."""
    points: dict[str, list[tuple[float, float, float]]] = {}
    for row, (n, d) in zip(rows, n_and_d):
        pts = points.setdefault(variant_name(row, keys) or "all", [])
        if (loss := _finished(row)) is not None and n and d:
            pts.append((float(n), float(d), loss))
    out, problems = [], {}
    for name, pts in points.items():
        row: dict[str, Any] = {"variant": name, "points": len(pts)}
        try:
            fit = fit_chinchilla([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts])
        except ValueError as err:
            problems[name] = row["problem"] = str(err)
        else:
            row.update(E=fit.E, E_ci95=_ci(fit.E_ci), A=fit.A, A_ci95=_ci(fit.A_ci), alpha=fit.alpha,
                       alpha_ci95=_ci(fit.alpha_ci), B=fit.B, B_ci95=_ci(fit.B_ci), beta=fit.beta,
                       beta_ci95=_ci(fit.beta_ci), rmse=fit.rmse, n_opt_exponent=fit.n_opt_exponent, problem="")
        out.append(row)
    if len(problems) == len(points):  # no fit: say why once (per variant where the reasons differ)
        why = set(problems.values())
        return "\nL(N, D) not fitted: " + (why.pop() if len(why) == 1 else
                                           "; ".join(f"{k}: {v}" for k, v in problems.items())) + "\n"
    md = write_table(out, ND_COLS, sweep_dir / "compare_ladder_nd")
    return ("\nScaling fits L(N, D) = E + A/N^α + B/D^β per variant (N: matmul weights, D: training tokens; "
            "n_opt_exponent: a in N_opt ∝ C^a at C = 6·N·D)\n\n" + md)


def ladder_section(rows: Sequence[dict[str, Any]], computes: Sequence[float | None], variant_keys: Sequence[str],
                   sweep_dir: Path, baseline: str | None = None,
                   n_and_d: Sequence[tuple[float | None, float | None]] | None = None) -> str:
    """The ladder's markdown (empty when no key sets the size, or fewer than 2 sizes ran); writes compare_ladder.*
    and plots/loss_vs_compute.png. `rows`: compare's per-run rows, `computes`: each run's compute, `n_and_d`: each
    run's (N, D) for the L(N, D) fit (None: not fitted)."""
    sizes = size_keys(variant_keys)
    if not sizes or len({tuple(r.get(k) for k in sizes) for r in rows}) < 2:
        return ""
    keys = [k for k in variant_keys if k not in sizes]
    points: dict[str, list[tuple[float, float]]] = {}
    for row, c in zip(rows, computes):
        pts = points.setdefault(variant_name(row, keys) or "all", [])
        if (loss := _finished(row)) is not None and c:
            pts.append((c, loss))
    fits, problems = {}, {}
    for name, pts in points.items():
        try:
            fits[name] = fit_power_law([c for c, _ in pts], [v for _, v in pts])
        except ValueError as err:
            problems[name] = str(err)
    base = pick_baseline(list(points), baseline)
    out = []
    for name, pts in points.items():
        fit = fits.get(name)
        row = {"variant": name, "points": len(pts), "problem": problems.get(name, "")}
        if fit is not None:
            row.update(E=fit.E, E_ci95=_ci(fit.E_ci), A=fit.A, alpha=fit.alpha, alpha_ci95=_ci(fit.alpha_ci),
                       rmse=fit.rmse)
            if name != base and base in fits:
                cs = [c for c, _ in points[base]]
                row["multiplier_at_max_C"] = compute_multiplier(fit, fits[base], max(cs))
                row["multiplier_at_min_C"] = compute_multiplier(fit, fits[base], min(cs))
                roots = crossover(fit, fits[base], min(cs), max(cs))
                row["crossover_C"] = " ".join(f"{r:.3g}" for r in roots) or "none"
        out.append(row)
    md = write_table(out, COLS, sweep_dir / "compare_ladder")
    if not fits:  # (a study of 1-step runs, sizes without a finished loss): no curve to draw, a line says why
        return ("\nScaling fits L(C) = E + A·C^(−α): none, no variant has the 3 sizes with a finished val loss a fit "
                "needs (the `problem` column of compare_ladder.csv says per variant)\n")
    plot_loss_vs_compute(points, fits, sweep_dir / "plots" / "loss_vs_compute.png")
    md = (f"\nScaling fits L(C) = E + A·C^(−α) per variant (C: training FLOPs; multipliers: the compute each needs "
          f"for the baseline {base}'s loss, as a multiple of the baseline's)\n\n" + md)
    return md + (nd_section(rows, n_and_d, keys, sweep_dir) if n_and_d is not None else "")


@section(60)
def ladder(sweep: Sweep) -> str:
    """Runs that differ by model size or budget: the scaling fits (lmlab.analysis.ladder)."""
    pairs = list(zip(sweep.summaries.values(), sweep.rows))
    return ladder_section(sweep.rows, [compute_spent(s, row["flops_per_token"]) for s, row in pairs],
                          sweep.variant_keys, sweep.dir, sweep.baseline,
                          n_and_d=[(row["n_matmul"], s.get("tokens")) for s, row in pairs])
