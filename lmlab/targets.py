"""Steps, tokens, FLOPs and time a run took to reach a target validation loss, read off its val curve.

A variant that is better at the end may only be faster, or may need more compute per step; the cost to a fixed
loss compares them on one axis. The crossing is interpolated linearly between the two validations that bracket it
(the first validation at or below the target, and the one before); a curve that starts below the target reached it
at its first validation; one that never gets there has None. Tokens are read off the run's `tokens` curve at that
step (else tokens per step from the summary), FLOPs are tokens × the run's train FLOPs per token
(`lmlab.perf.flops_per_token`), and time is the run's wall time × the fraction of its steps (training time is close
to linear in steps; validation is included as it was spent).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from lmlab import names

TARGET_FIGURES = ("steps_to_target", "tokens_to_target", "flops_to_target", "time_to_target_s")


def crossing(curve: Sequence[tuple[int, float]], target: float) -> float | None:
    """The (fractional) step at which `curve` [(step, loss), ...] first reaches `target`, or None."""
    points = [(s, v) for s, v in curve if math.isfinite(v)]
    for i, (step, value) in enumerate(points):
        if value <= target:
            if i == 0:
                return float(step)
            s0, v0 = points[i - 1]
            return s0 + (v0 - target) / (v0 - value) * (step - s0)
    return None


def _at(curve: Sequence[tuple[int, float]], step: float) -> float | None:
    """`curve` linearly interpolated at `step` (None outside it)."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return v0 if s1 == s0 else v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return curve[0][1] if curve and curve[0][0] == step else None


def to_target(series: Mapping[str, Sequence[tuple[int, float]]], summary: Mapping[str, Any], target: float,
              flops_per_token: float | None) -> dict[str, float | None]:
    """TARGET_FIGURES of one run: `series` its metrics.csv (lmlab.plots.read_metrics), `summary` its summary.json."""
    step = crossing(series.get(names.VAL_LOSS, []), target)
    out: dict[str, float | None] = dict.fromkeys(TARGET_FIGURES)
    if step is None:
        return out
    out["steps_to_target"] = step
    steps, tokens, wall = summary.get("steps"), summary.get("tokens"), summary.get("wall_time_s")
    tok = _at(list(series.get(names.TOKENS, [])), step)
    if tok is None and steps and tokens:
        tok = tokens / steps * step
    out["tokens_to_target"] = tok
    if tok is not None and flops_per_token:
        out["flops_to_target"] = tok * flops_per_token
    if steps and wall:
        out["time_to_target_s"] = wall * step / steps
    return out


def default_target(best_losses: Sequence[float | None]) -> float | None:
    """The loss every run reached: the highest best val loss among the runs that have one."""
    finite = [v for v in best_losses if isinstance(v, (int, float)) and math.isfinite(v)]
    return max(finite) if finite else None
