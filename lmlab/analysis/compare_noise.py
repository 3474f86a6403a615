"""compare's noise-floor section: per metric, how much a figure moves when nothing but luck changes, and whether each
variant's difference from the baseline is above that.

The metrics: the final val loss (`final_val_loss`, its curve `val/loss`), the final val bits per byte when runs have
it (`final_val_bpb`, `val/bpb`) and each downstream score the summaries hold (`downstream/<task>/<metric>`,
summary.json's `downstream` figures, each its own curve in metrics.csv). For each metric and variant (the runs that
differ only by their seeds), over its completed runs:

- `seed_sd`: the spread over seeds, the sample sd (n − 1) of the runs' figures (two runs or more);
- `step_sd`: the step-to-step noise, each run's sample sd of its last LAST_K validations of the metric's curve (the
  summary's `val_curve` for val loss, else metrics.csv), pooled over the variant's runs as the root mean square.

Each variant against the baseline (`baseline=`, default the first): `diff` = mean(variant) − mean(baseline); `floor`
= the pooled noise √((s_b² + s_v²)/2) of the seed sds when both have two seeds or more (`floor_from` seeds), else of
the step-to-step sds they have (steps); `snr` = |diff| / floor (Cohen's d for seeds); `below_floor` when
|diff| < FLOORS · floor, or diff = 0; `seeds_needed`: the seeds per variant a two-sample t test needs to resolve the
difference at that floor with 80% power at α 0.05, exact (lmlab.analysis.significance.seeds_needed_exact).

A step-to-step floor is a lower bound on the seed spread (a run's last validations share its init and data order):
a difference above it may still be seed luck. compare_noise.{md,csv}: one row per metric and variant.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmlab import names
from lmlab.analysis.compare_stats import pick_baseline
from lmlab.analysis.sections import Sweep, section
from lmlab.analysis.significance import seeds_needed_exact
from lmlab.record.tables import write_table

LAST_K = 5  # validations at the end of a run whose spread is its step-to-step noise
FLOORS = 2.0  # a difference below this many floors is marked below_floor
METRICS = {"final_val_loss": names.VAL_LOSS, "final_val_bpb": names.VAL_BPB}  # summary figure -> its curve
COLS = ("metric", "variant", "runs", "mean", "seed_sd", "step_sd", "diff", "floor", "floor_from", "snr",
        "below_floor", "seeds_needed")


def step_sd(curve: Sequence[tuple[int, float]], k: int = LAST_K) -> float | None:
    """The sample sd of the last `k` finite values of `curve` ((step, value) pairs); None with fewer than two."""
    values = [float(v) for _, v in curve if v is not None and math.isfinite(v)][-k:]
    return statistics.stdev(values) if len(values) > 1 else None


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def figures(summary: Mapping[str, Any]) -> dict[str, float]:
    """A run's figure of each metric it has: final val loss and bpb, and its downstream scores (summary.json's
    `downstream.metrics`, or top-level `downstream/...` keys)."""
    out = {m: v for m in METRICS if (v := _number(summary.get(m))) is not None}
    last = summary.get("downstream")
    scores = last.get("metrics") if isinstance(last, dict) and isinstance(last.get("metrics"), dict) else {}
    scores = {**{k: v for k, v in summary.items() if k.startswith(f"{names.DOWNSTREAM}/")}, **scores}
    out |= {k: x for k, v in sorted(scores.items()) if (x := _number(v)) is not None}
    return out


def _curve(sweep: Sweep, run: Path, metric: str) -> list[tuple[int, float]]:
    """The run's curve of `metric`: for val loss the summary's val_curve (metrics.csv for an older run)."""
    curve = sweep.summaries[run].get("val_curve")
    if metric == "final_val_loss" and isinstance(curve, list):
        return [(s, v) for s, v in curve if _number(v) is not None]
    return sweep.logged.get(run, {}).get(METRICS.get(metric, metric), [])


def _pooled(sds: Sequence[float | None]) -> float | None:
    have = [s for s in sds if s is not None]
    return math.sqrt(statistics.fmean(s * s for s in have)) if have else None


def noise_rows(sweep: Sweep, k: int = LAST_K) -> list[dict[str, Any]]:
    """The section's rows (module docstring), metric by metric, the baseline variant first."""
    keys = sweep.variant_keys
    groups: dict[str, list[Path]] = {}
    for run in sweep.runs:
        if sweep.summaries[run].get("status") == "completed":
            groups.setdefault(sweep.name(run, keys) if keys else "all runs", []).append(run)
    if not groups:
        return []
    try:
        base = pick_baseline(list(groups), sweep.baseline)
    except ValueError:  # a baseline that names no single variant here (a ladder's sizes): floors without differences
        base = None
    order = sorted(groups, key=lambda name: name != base)
    metrics = list(dict.fromkeys(m for runs in groups.values() for r in runs for m in figures(sweep.summaries[r])))
    rows = []
    for metric in metrics:
        stats: dict[str, dict[str, Any]] = {}
        for name in order:
            values = {r: v for r in groups[name] if (v := figures(sweep.summaries[r]).get(metric)) is not None}
            if not values:
                continue
            xs = list(values.values())
            stats[name] = {"metric": metric, "variant": name, "runs": len(xs), "mean": statistics.fmean(xs),
                           "seed_sd": statistics.stdev(xs) if len(xs) > 1 else None,
                           "step_sd": _pooled([step_sd(_curve(sweep, r, metric), k) for r in values])}
        for name, row in stats.items():
            if base in stats and name != base:
                row.update(difference(stats[base], row))
            rows.append(row)
    return rows


def difference(base: Mapping[str, Any], row: Mapping[str, Any]) -> dict[str, Any]:
    """diff, floor, floor_from, snr, below_floor and seeds_needed of `row` against `base` (module docstring)."""
    diff = row["mean"] - base["mean"]
    if base["seed_sd"] is not None and row["seed_sd"] is not None:
        floor, source = _pooled([base["seed_sd"], row["seed_sd"]]), "seeds"
    else:
        floor, source = _pooled([base["step_sd"], row["step_sd"]]), "steps"
    if floor is None:
        return {"diff": diff, "floor_from": "none (one seed, fewer than two validations)"}
    snr = abs(diff) / floor if floor > 0 else (math.inf if diff else 0.0)
    return {"diff": diff, "floor": floor, "floor_from": source, "snr": snr,
            "below_floor": diff == 0 or abs(diff) < FLOORS * floor,
            "seeds_needed": seeds_needed_exact(snr, paired=False) if 0 < snr < math.inf else None}


@section(13)
def noise(sweep: Sweep) -> str:
    """The noise-floor section (module docstring); empty when no metric has a seed or step-to-step spread."""
    rows = noise_rows(sweep)
    if not any(r["seed_sd"] is not None or r["step_sd"] is not None for r in rows):
        return ""
    return (f"\nNoise floors per metric: sd over seeds and over each run's last {LAST_K} validations; each "
            f"difference from the baseline over its floor (below_floor: |diff| < {FLOORS:g} floors)\n\n"
            + write_table(rows, COLS, sweep.dir / "compare_noise"))
