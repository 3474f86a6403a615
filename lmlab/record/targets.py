"""Steps, tokens, FLOPs and time a run took to reach a target validation loss, read off its val curve.

A variant that is better at the end may only be faster, or may need more compute per step; the cost to a fixed
loss compares them on one axis. The crossing is interpolated linearly between the two validations that bracket it
(the first validation at or below the target, and the one before); a curve that starts below the target reached it
at its first validation; one that never gets there has None.

The curve is summary.json's `val_curve`: (optimizer steps done, val loss) at every validation. Tokens at that step
are the run's tokens per step × the step, FLOPs are tokens × the run's train FLOPs per token
(`lmlab.model.flops.flops_per_token`) — under a batch or length schedule both summed over its `stages` — and time is the
run's wall time over all its attempts × the fraction of its steps (training time is close to linear in steps;
validation is included as it was spent). A run of an older lmlab has no `val_curve`: its metrics.csv is read instead,
whose val rows are Lightning's logging steps (one behind the optimizer steps for a validation during fit), with
tokens read off its `tokens` curve.

A run reports these figures for its own targets (train.yaml's `targets:` list, run_targets): summary.json's
`to_target` and the W&B run's summary (wandb_keys: `steps_to_target_2p5` for a target of 2.5); `eval.py compare=`
counts to `target=` (default: the runs' first configured target, else the sweep's highest best val loss) with the
same function, so the two agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from lmlab import names

TARGET_FIGURES = ("steps_to_target", "tokens_to_target", "flops_to_target", "time_to_target_s")


class ToTarget(TypedDict):
    """One entry of summary.json's `to_target`: what the run took to reach the val loss `target` (None: never)."""

    target: float
    steps_to_target: float | None
    tokens_to_target: float | None
    flops_to_target: float | None
    time_to_target_s: float | None


def crossing(curve: Sequence[tuple[int, float]], target: float) -> float | None:
    """The (fractional) step at which `curve` [(step, loss), ...] first reaches `target`, or None."""
    points = [(s, v) for s, v in curve if v is not None and math.isfinite(v)]  # null in JSON: a non-finite loss
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


def run_wall(summary: Mapping[str, Any]) -> float | None:
    """The run's wall time: the sum over its attempts (a resumed run's `wall_time_s` is its last attempt's), else
    `wall_time_s` (a summary without the attempts' times)."""
    walls = [a.get("wall_time_s") for a in summary.get("attempts") or []]
    if walls and all(isinstance(w, (int, float)) for w in walls):
        return float(sum(walls))
    return summary.get("wall_time_s")


def through(stages: list[dict[str, Any]], step: float) -> tuple[float, float]:
    """(tokens, train FLOPs) of the first `step` optimizer steps (fractional: interpolated within its stage), from
    lmlab.data.stages.table's stages (summary.json's `stages`)."""
    tokens = flops = 0.0
    ends = [s["from_step"] for s in stages[1:]] + [math.inf]
    for stage, end in zip(stages, ends):
        n = max(0.0, min(step, end) - stage["from_step"])
        tokens += n * stage["tokens_per_step"]
        flops += n * stage["tokens_per_step"] * stage["flops_per_token"]
    return tokens, flops


def to_target(series: Mapping[str, Sequence[tuple[int, float]]], summary: Mapping[str, Any], target: float,
              flops_per_token: float | None) -> dict[str, float | None]:
    """TARGET_FIGURES of one run: `summary` its summary.json (its `val_curve`), `series` its metrics.csv
    (lmlab.record.plots.read_metrics), read only when the summary has no `val_curve`."""
    curve = summary.get("val_curve")
    on_summary = isinstance(curve, list)
    step = crossing(curve if on_summary else series.get(names.VAL_LOSS, []), target)
    out: dict[str, float | None] = dict.fromkeys(TARGET_FIGURES)
    if step is None:
        return out
    out["steps_to_target"] = step
    steps, tokens, wall = summary.get("steps"), summary.get("tokens"), run_wall(summary)
    if stages := summary.get("stages"):  # a batch or length schedule: each stage's tokens and FLOPs per token
        out["tokens_to_target"], out["flops_to_target"] = through(stages, step)
    else:
        tok = None if on_summary else _at(list(series.get(names.TOKENS, [])), step)
        if tok is None and steps and tokens:
            tok = tokens / steps * step
        out["tokens_to_target"] = tok
        if tok is not None and flops_per_token:
            out["flops_to_target"] = tok * flops_per_token
    if steps and wall:
        out["time_to_target_s"] = wall * step / steps
    return out


def check_targets(targets: Any) -> list[float]:
    """train.yaml's `targets` as floats; refuses anything but a list of finite val losses > 0, by key."""
    if targets is None:
        return []
    if isinstance(targets, (str, bytes)) or not isinstance(targets, Sequence):
        raise ValueError(f"targets={targets!r} must be a list of val losses, e.g. targets=[2.5,2.0] (or [])")
    for t in targets:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"targets={list(targets)!r}: {t!r} is not a val loss (a finite number > 0)")
    return [float(t) for t in targets]


def run_targets(summary: Mapping[str, Any], targets: Sequence[float]) -> list[ToTarget]:
    """summary.json's `to_target`: the figures for each of the run's `targets`, from the summary itself (its
    val_curve, steps, tokens, flops_per_token and attempts' wall times)."""
    return [ToTarget(target=float(t), **to_target({}, summary, t, summary.get("flops_per_token"))) for t in targets]


def wandb_keys(to_target_: Sequence[Mapping[str, Any]] | None) -> dict[str, float | None]:
    """The W&B summary's names for `to_target`: <figure>_<target>, its decimal point a `p` (steps_to_target_2p5):
    W&B sorts and filters only names of letters, digits and underscores."""
    out: dict[str, float | None] = {}
    for entry in to_target_ or []:
        tag = repr(float(entry["target"])).removesuffix(".0").replace(".", "p").replace("-", "m").replace("+", "")
        out.update({f"{fig}_{tag}": entry.get(fig) for fig in TARGET_FIGURES})
    return out


def default_target(best_losses: Sequence[float | None], configured: Sequence[Any] = ()) -> float | None:
    """compare's target: the first of the runs' configured `targets` when they all have the same list (`configured`:
    each run's), else the loss every run reached, the highest best val loss among the runs that have one."""
    lists = [tuple(c) for c in configured if c]
    if lists and len(lists) == len(configured) and len(set(lists)) == 1:
        return float(lists[0][0])
    finite = [v for v in best_losses if isinstance(v, (int, float)) and math.isfinite(v)]
    return max(finite) if finite else None
