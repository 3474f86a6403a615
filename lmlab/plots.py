"""PNG plots from runs: loss and grad-norm curves, the gradient-norm profile at init. Matplotlib, Agg backend."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

Series = Mapping[str, list[tuple[int, float]]]  # one run's metrics.csv: {metric: [(step, value), ...]}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.csv -> {metric: [(step, value), ...]} (Lightning's CSV: one row per logging call, blanks elsewhere)."""
    series: dict[str, list[tuple[int, float]]] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = int(float(row.get("step") or 0))
            for key, value in row.items():
                if key in ("step", "epoch") or value in ("", None):
                    continue
                series.setdefault(key, []).append((step, float(value)))
    return series


def plot_init_profile(profiles: Mapping[str, Mapping[str, float]], path: str | Path, title: str = "") -> Path:
    """Gradient norm per part at initialisation (embed, layer_00 .. layer_NN, head), one line per run."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, profile in profiles.items():
        layers = [k for k in profile if k.startswith("layer_")]
        ax.plot(range(len(layers)), [profile[k] for k in layers], marker="o", label=name)
    ax.set_yscale("log")
    return _finish(fig, ax, path, "layer", "gradient norm at init",
                   title or "Gradient norm per layer at initialisation (Xiong et al. 2020, Fig. 3)")


def seed_band(runs: Sequence[Series], metric: str) -> tuple[list[int], list[float], list[float]]:
    """Mean and sample sd (n − 1) of `metric` over `runs` (the seeds of one variant) at every step any of them logged;
    the sd is 0 where only one run has the step (a diverged seed stops early). Non-finite values are left out."""
    by_step: dict[int, list[float]] = {}
    for series in runs:
        for step, value in series.get(metric, []):
            if math.isfinite(value):
                by_step.setdefault(step, []).append(value)
    steps = sorted(by_step)
    mean = [statistics.fmean(by_step[s]) for s in steps]
    sd = [statistics.stdev(by_step[s]) if len(by_step[s]) > 1 else 0.0 for s in steps]
    return steps, mean, sd


def plot_curves(runs: Mapping[str, Series | Sequence[Series]], metric: str, path: str | Path, log: bool = False,
                title: str = "") -> Path | None:
    """One line per name for `metric` (e.g. train/loss), from metrics.csv series: a name mapped to one run is its
    curve, a name mapped to several (the seeds of a variant) is their mean with a ± sd band. None if no run has more
    than one point of it (a curve needs two)."""
    groups = {name: [r] if isinstance(r, Mapping) else list(r) for name, r in runs.items()}
    if not any(len(series.get(metric, [])) > 1 for group in groups.values() for series in group):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, group in groups.items():
        steps, mean, sd = seed_band(group, metric)
        if not steps:
            continue
        (line,) = ax.plot(steps, mean, label=name if len(group) == 1 else f"{name} (mean ± sd, n={len(group)})",
                          linewidth=1)
        if len(group) > 1:
            low = [max(m - d, m / 10) if log else m - d for m, d in zip(mean, sd)]  # log axes: no bound <= 0
            ax.fill_between(steps, low, [m + d for m, d in zip(mean, sd)], color=line.get_color(), alpha=0.2,
                            linewidth=0)
    if log:
        ax.set_yscale("log")
    return _finish(fig, ax, path, "step", metric, title or metric)


def _finish(fig, ax, path: str | Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Labels, legend, grid, then save: the common end of every plot."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def plot_extension(curves: Mapping[str, Mapping[int, list[float]]], trained_len: int, path: str | Path) -> Path:
    """Loss vs position at the longest evaluated length, one line per RoPE scaling method (smoothed over 1/64 of
    the length), with the trained length marked."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, by_len in curves.items():
        longest = max(by_len)
        y = by_len[longest]
        k = max(1, len(y) // 64)
        smooth = [sum(y[i:i + k]) / len(y[i:i + k]) for i in range(0, len(y), k)]
        ax.plot([i + k / 2 for i in range(0, len(y), k)], smooth, label=name, linewidth=1)
    ax.axvline(trained_len, color="k", linestyle="--", linewidth=0.8, label="trained length")
    return _finish(fig, ax, path, "position", "loss", "Zero-shot length extension")


def plot_length_sweep(rows: list[Mapping], trained_len: int, path: str | Path) -> Path:
    """Mean loss over all positions vs evaluated length, one line per RoPE scaling method (log2 x axis)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in sorted({r["rope_scaling"] for r in rows}):
        points = sorted((r["length"], r["loss"]) for r in rows if r["rope_scaling"] == name)
        ax.plot(*zip(*points), marker="o", label=name, linewidth=1)
    ax.axvline(trained_len, color="k", linestyle="--", linewidth=0.8, label="trained length")
    ax.set_xscale("log", base=2)
    return _finish(fig, ax, path, "evaluated length (tokens)", "mean loss over the window",
                   "Zero-shot length extension: loss vs length")
