"""What `eval.py compare=` could not draw or rank, and why: one line each, printed above its tables and written at the
top of compare.md, so a plot the README lists that is missing, or a column that cannot tell runs apart, is explained
instead of silently absent or silently equal."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmlab import names
from lmlab.record.targets import TARGET_FIGURES

CURVES = {names.TRAIN_LOSS: "train_loss.png", names.VAL_LOSS: "val_loss.png", names.GRAD_NORM: "grad_norm.png"}
MORE_VALIDATIONS = "validate more often: trainer.val_check_interval=<steps> below trainer.max_steps"


def validations(summary: Mapping[str, Any], metrics: Mapping[str, Sequence]) -> int:
    """How many times a run validated: its summary's val_curve, else (an older run) its metrics.csv val rows."""
    curve = summary.get("val_curve")
    return len(curve) if isinstance(curve, list) else len(metrics.get(names.VAL_LOSS, []))


def gaps(drawn: Mapping[str, Path | None], counts: Sequence[int], target: float | None) -> list[str]:
    """One line per curve plot not drawn (`drawn`: metric -> the plot's path, None when plot_curves drew nothing)
    and for the *_to_target columns when no run validated twice (`counts`: validations per run)."""
    once = bool(counts) and max(counts) <= 1
    notes = []
    for metric, path in drawn.items():
        if path is None:
            why = ("each run validated once or never, and a curve needs two points; " + MORE_VALIDATIONS
                   if metric == names.VAL_LOSS and once else f"no run logged {metric} at two steps or more")
            notes.append(f"plots/{CURVES[metric]} not drawn: {why}")
    if target is not None and once:
        notes.append(f"{', '.join(TARGET_FIGURES)} carry no information: each run validated once, so a run that "
                     f"reached the target {target:.4g} did so at its only validation, its last step (the columns are "
                     f"its steps, tokens, FLOPs and time, not a speed); {MORE_VALIDATIONS}")
    return notes
