"""PNG plots from runs: loss and grad-norm curves, the gradient-norm profile at init. Matplotlib, Agg backend."""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping
from pathlib import Path


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


def plot_curves(runs: Mapping[str, Mapping[str, list[tuple[int, float]]]], metric: str, path: str | Path,
                log: bool = False, title: str = "") -> Path | None:
    """One line per run for `metric` (e.g. train/loss), from each run's metrics.csv series; None if no run has
    more than one point of it (a curve needs two)."""
    if not any(len(series.get(metric, [])) > 1 for series in runs.values()):
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, series in runs.items():
        points = [(s, v) for s, v in series.get(metric, []) if math.isfinite(v)]
        if points:
            ax.plot(*zip(*points), label=name, linewidth=1)
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
