"""PNG plots from runs: loss and grad-norm curves, the gradient-norm profile at init, an MoE's expert load by layer
and step. Matplotlib, Agg backend."""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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


def plot_init_profile(profiles: Mapping[str, Mapping[str, float]], path: str | Path, title: str = "",
                      ylabel: str = "gradient norm at init") -> Path:
    """A figure per layer (layer_00 .. layer_NN; other keys such as embed and head are left out), one line per run:
    by default the gradient norm at initialisation."""
    fig, ax = init_profile_axes(profiles)
    return _finish(fig, ax, path, "layer", ylabel,
                   title or "Gradient norm per layer at initialisation (Xiong et al. 2020, Fig. 3)")


def init_profile_axes(profiles: Mapping[str, Mapping[str, float]]) -> tuple[Any, Any]:
    """plot_init_profile's figure before it is labelled and saved: layers are counted, so the ticks are integers
    (matplotlib's default locator put 0.5, 1.5, ... between the layers of a 4-layer model)."""
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, profile in profiles.items():
        layers = [k for k in profile if k.startswith("layer_")]
        ax.plot(range(len(layers)), [profile[k] for k in layers], marker="o", label=name)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    return fig, ax


def layer_profile(series: Mapping[str, Sequence[tuple[int, float]]], prefix: str, at: str = "first"
                  ) -> dict[str, float]:
    """{layer_XX: value} of the per-layer figure `prefix`/layer_XX (e.g. jac/norm) at its first or last measured
    step (`at`); {} when the run did not measure it."""
    cols = sorted(k for k in series if k.startswith(f"{prefix}/layer_") and k.count("/") == prefix.count("/") + 1)
    steps = sorted({s for k in cols for s, _ in series[k]})
    if not steps:
        return {}
    step = steps[0] if at == "first" else steps[-1]
    return {k.rsplit("/", 1)[1]: v for k in cols for s, v in series[k] if s == step}


def plot_probe(results: Mapping[str, Mapping[str, list[float]]], path: str | Path, title: str = "") -> Path:
    """Su's position probe (data=position_probe), one row per variant: accuracy (left) and |argmax − position|
    (right) at each position, as heatmaps. `results`: name -> {"position", "accuracy", "error"} (a probe.json, or the
    mean of a variant's seeds); shorter runs are padded with blanks."""
    plt = _plt()
    names = list(results)
    width = max(len(r["position"]) for r in results.values())
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.3 * len(names) + 1.8), sharey=True)
    for ax, key, cmap, label, vmax in ((axes[0], "accuracy", "viridis", "accuracy", 1.0),
                                       (axes[1], "error", "magma_r", "|argmax − position|", None)):
        grid = [list(results[n][key]) + [math.nan] * (width - len(results[n][key])) for n in names]
        im = ax.imshow(grid, aspect="auto", cmap=cmap, interpolation="nearest", vmin=0, vmax=vmax,
                       extent=(0.5, width + 0.5, len(names) - 0.5, -0.5))
        fig.colorbar(im, ax=ax, label=label, fraction=0.04)
        ax.set_xlabel("position")
        ax.set_title(label)
    axes[0].set_yticks(range(len(names)), names, fontsize=7)
    fig.suptitle(title or "Position probe: input [0, ..., 0], targets [1, ..., n]")
    return _save(fig, path)


def plot_expert_load(runs: Mapping[str, Series], path: str | Path, figure: str = "load_max_over_mean",
                     title: str = "") -> Path | None:
    """An MoE's `moe/<figure>/layer_XX` (lmlab.model.moe.figures; by default each layer's busiest expert's load over
    the mean, 1 = balanced) as a heat map of layer by step, one panel per run. None if no run logged it."""
    prefix = f"moe/{figure}/"
    panels = {name: {k[len(prefix):]: dict(v) for k, v in series.items() if k.startswith(prefix)}
              for name, series in runs.items()}
    panels = {name: layers for name, layers in panels.items() if layers}
    if not panels:
        return None
    plt = _plt()
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 1.2 + 0.35 * sum(len(v) for v in panels.values())
                                                       + 0.6 * len(panels)), squeeze=False)
    top = max(v for layers in panels.values() for by_step in layers.values() for v in by_step.values())
    for ax, (name, layers) in zip(axes[:, 0], panels.items()):
        steps = sorted({s for by_step in layers.values() for s in by_step})
        grid = [[layers[layer].get(s, math.nan) for s in steps] for layer in sorted(layers)]
        im = ax.imshow(grid, aspect="auto", cmap="magma", interpolation="nearest", vmin=0, vmax=top,
                       extent=(steps[0] - 0.5, steps[-1] + 0.5, len(layers) - 0.5, -0.5))
        ax.set_yticks(range(len(layers)), sorted(layers), fontsize=7)
        ax.set_title(name, fontsize=8)
        fig.colorbar(im, ax=ax, label=figure, fraction=0.04)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or f"expert load by layer and step: {figure}")
    return _save(fig, path)


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


def plot_length_sweep(rows: list[Mapping], trained_len: int, path: str | Path, by: str = "rope_scaling",
                      column: str = "loss", title: str = "") -> Path:
    """`column` of eval's rows (loss: the mean over all positions of the window) vs evaluated length, one line per
    value of `by` (a RoPE scaling method; a run, for a sweep), log2 x axis."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = sorted({r[by] for r in rows})
    colors = plt.get_cmap("tab20" if len(names) > 10 else "tab10").colors  # tab10 repeats after 10 lines
    for i, name in enumerate(names):
        points = sorted((r["length"], r[column]) for r in rows if r[by] == name and r[column] is not None)
        if points:
            ax.plot(*zip(*points), marker="o", label=name, linewidth=1, color=colors[i % len(colors)])
    ax.axvline(trained_len, color="k", linestyle="--", linewidth=0.8, label="trained length")
    ax.set_xscale("log", base=2)
    ylabel = "mean loss over the window" if column == "loss" else column
    return _finish(fig, ax, path, "evaluated length (tokens)", ylabel,
                   title or "Zero-shot length extension: loss vs length")


def sweep_runs(sweep_dir: str | Path, needs: str = "metrics.csv") -> dict[str, Path]:
    """The run directories under a sweep that hold `needs`, each named by its overrides minus those every run shares
    (the job dir `experiment=x,placement=post` of a sweep over placement is `placement=post`)."""
    dirs = sorted({p.parent.parent if needs.startswith("eval/") else p.parent
                   for p in Path(sweep_dir).rglob(Path(needs).name)
                   if "wandb" not in p.parts and str(p).endswith(needs)})
    parts = {d: d.name.split(",") for d in dirs}
    common = set.intersection(*(set(v) for v in parts.values())) if len(dirs) > 1 else set()
    return {",".join(x for x in v if x not in common) or d.name: d for d, v in parts.items()}


def main(argv: Sequence[str] | None = None) -> None:
    """python -m lmlab.record.plots curves <sweep> <metric> [--log] --out PNG: one line per run of the sweep for any
    metric of
    metrics.csv (e.g. update/output_change, act/ratio/layer_00/attn), beyond the three that compare draws.
    python -m lmlab.record.plots moe <sweep or run> [--figure load_cv] --out PNG: an MoE's expert load by layer and
    step.
    python -m lmlab.record.plots lengths <sweep> [--column loss_beyond] --out PNG: each run's eval/eval.json (after
    eval.py
    run=<job> lengths=[...]) as one line of loss vs evaluated length, from its unscaled rows (rope_scaling none)."""
    import argparse
    import json

    parser = argparse.ArgumentParser(prog="python -m lmlab.record.plots")
    sub = parser.add_subparsers(dest="kind", required=True)
    curves = sub.add_parser("curves", help="a metrics.csv metric vs step, one line per run of a sweep")
    curves.add_argument("sweep")
    curves.add_argument("metric")
    curves.add_argument("--log", action="store_true", help="log y axis")
    curves.add_argument("--title", default="")
    curves.add_argument("--out", required=True)
    moe = sub.add_parser("moe", help="an MoE's expert load as a heat map of layer by step, one panel per run")
    moe.add_argument("sweep")
    moe.add_argument("--figure", default="load_max_over_mean",
                     choices=["load_max_over_mean", "load_cv", "router_entropy", "dropped", "balance_loss",
                              "router_z_loss"])
    moe.add_argument("--out", required=True)
    lengths = sub.add_parser("lengths", help="eval.py's loss vs evaluated length, one line per run of a sweep")
    lengths.add_argument("sweep")
    lengths.add_argument("--column", default="loss", choices=["loss", "loss_inside", "loss_beyond", "ppl"])
    lengths.add_argument("--title", default="")
    lengths.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    if args.kind == "curves":
        runs = {name: read_metrics(d / "metrics.csv") for name, d in sweep_runs(args.sweep).items()}
        if plot_curves(runs, args.metric, args.out, log=args.log, title=args.title) is None:
            raise SystemExit(f"no run under {args.sweep} logged {args.metric} at two steps or more")
    elif args.kind == "moe":
        runs = {name: read_metrics(d / "metrics.csv") for name, d in sweep_runs(args.sweep).items()}
        if plot_expert_load(runs, args.out, args.figure) is None:
            raise SystemExit(f"no run under {args.sweep} logged moe/{args.figure}/layer_XX (ffn=moe runs do)")
    else:
        rows, trained = [], set()
        for name, d in sweep_runs(args.sweep, "eval/eval.json").items():
            result = json.loads((d / "eval" / "eval.json").read_text())
            trained.add(result["trained_len"])
            rows += [{**r, "run": name} for r in result["rows"] if r["rope_scaling"] == "none"]
        if not rows:
            raise SystemExit(f"no <run>/eval/eval.json under {args.sweep}: run eval.py run=<job> lengths=[...] first")
        plot_length_sweep(rows, min(trained), args.out, by="run", column=args.column, title=args.title)
    print(f"-> {args.out}")


if __name__ == "__main__":
    main()


def plot_loss_vs_compute(points: Mapping[str, Sequence[tuple[float, float]]], fits: Mapping[str, Any],
                         path: str | Path) -> Path | None:
    """A ladder: each variant's (compute, loss) points, its fit L(C) = E + A·C^(−α) as a line over the points'
    range (dashed a decade past it) and the fit's 95% band (lmlab.analysis.fits.PowerLaw.band). None without points."""
    if not any(points.values()):
        return None
    import numpy as np

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in points.items():
        cs, ls = [c for c, _ in pts], [v for _, v in pts]
        (dots,) = ax.plot(cs, ls, "o", markersize=4)
        fit = fits.get(name)
        if fit is None:
            dots.set_label(f"{name} (no fit)")
            continue
        inside = np.logspace(math.log10(min(cs)), math.log10(max(cs)), 100)
        beyond = np.logspace(math.log10(max(cs)), math.log10(max(cs)) + 1, 30)
        label = f"{name}: {fit.E:.3g} + {fit.A:.3g}·C^-{fit.alpha:.3g}"
        ax.plot(inside, fit.loss(inside), color=dots.get_color(), linewidth=1, label=label)
        ax.plot(beyond, fit.loss(beyond), color=dots.get_color(), linewidth=1, linestyle="--")
        both = np.concatenate([inside, beyond])
        if (band := fit.band(both)) is not None:
            ax.fill_between(both, *band, color=dots.get_color(), alpha=0.15, linewidth=0)
    ax.set_xscale("log")
    return _finish(fig, ax, path, "training compute C (FLOPs)", "final val loss", "loss vs compute (fit, 95% band)")


def plot_recall(curves: Mapping[str, Sequence[float | None]], path: str | Path, title: str = "") -> Path:
    """Zoology's MQAR (data=mqar), one line per variant: the recall accuracy by key position (the pair a query's key
    was in, 0 = the first pair). `curves`: name -> accuracies (a recall.json's by_key_position, or the mean of a
    variant's seeds); None where no query asked that pair."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, accuracy in curves.items():
        ax.plot(range(len(accuracy)), [math.nan if a is None else a for a in accuracy], marker="o", markersize=3,
                linewidth=1, label=name)
    ax.set_ylim(-0.02, 1.02)
    return _finish(fig, ax, path, "key position (pair index in the context)", "recall accuracy",
                   title or "MQAR: accuracy at the queries by key position")
