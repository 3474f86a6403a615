"""compare's ladder section: a sweep whose runs differ in model size (a `model=` option or `model.*` keys) besides
the variant's own keys gets one scaling-law fit per variant (lmlab.fits) over its runs' (compute, final val loss).

compare_ladder.{md,csv}: per variant the points, E, A, α with 95% intervals, the fit's rmse, the compute-equivalent
multiplier against the baseline variant at the largest compute the baseline reached (and at the smallest), and the
computes where the two fits cross inside [C_min/1e6, C_max·1e6]; plots/loss_vs_compute.png draws the points, fits
and bands. Compute is what the run spent: summary.json's budget_spent.flops, else its tokens × train FLOPs per token.
A variant with fewer points than the fit's parameters has no fit and says so.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmlab.compare_stats import pick_baseline, variant_name
from lmlab.fits import compute_multiplier, crossover, fit_power_law
from lmlab.plots import plot_loss_vs_compute
from lmlab.tables import fmt, write_table

COLS = ("variant", "points", "E", "E_ci95", "A", "alpha", "alpha_ci95", "rmse", "multiplier_at_max_C",
        "multiplier_at_min_C", "crossover_C", "problem")


def size_keys(keys: Sequence[str]) -> list[str]:
    """The keys that set the model's size: the `model` group and its `model.*` values."""
    return [k for k in keys if k == "model" or k.startswith("model.")]


def compute_spent(summary: dict[str, Any], flops_per_token: float | None) -> float | None:
    spent = (summary.get("budget_spent") or {}).get("flops")
    if spent:
        return float(spent)
    tokens = summary.get("tokens")
    return float(tokens) * flops_per_token if tokens and flops_per_token else None


def _ci(ci: tuple[float, float] | None) -> str:
    return "" if ci is None else f"[{fmt(ci[0])}, {fmt(ci[1])}]"


def ladder_section(rows: Sequence[dict[str, Any]], computes: Sequence[float | None], variant_keys: Sequence[str],
                   sweep_dir: Path, baseline: str | None = None) -> str:
    """The ladder's markdown (empty when no key sets the size, or fewer than 2 sizes ran); writes compare_ladder.*
    and plots/loss_vs_compute.png. `rows`: compare's per-run rows, `computes`: each run's compute."""
    sizes = size_keys(variant_keys)
    if not sizes or len({tuple(r.get(k) for k in sizes) for r in rows}) < 2:
        return ""
    keys = [k for k in variant_keys if k not in sizes]
    points: dict[str, list[tuple[float, float]]] = {}
    for row, c in zip(rows, computes):
        name = variant_name(row, keys) or "all"
        loss = row.get("final_val_loss")
        points.setdefault(name, [])
        if row.get("status") == "completed" and c and isinstance(loss, (int, float)) and math.isfinite(loss):
            points[name].append((c, float(loss)))
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
    plot_loss_vs_compute(points, fits, sweep_dir / "plots" / "loss_vs_compute.png")
    md = write_table(out, COLS, sweep_dir / "compare_ladder")
    return (f"\nScaling fits L(C) = E + A·C^(−α) per variant (C: training FLOPs; multipliers: the compute each needs "
            f"for the baseline {base}'s loss, as a multiple of the baseline's)\n\n" + md)
