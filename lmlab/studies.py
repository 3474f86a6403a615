"""The optimizer and parametrisation studies read back: `optim_compare` (steps and tokens to a target val loss, final
loss at equal tokens, optimizer state per parameter), `lr_transfer` (the best lr per width under sp and mup, the µP
paper's Figure 1) and `mup_coord_check` (activation RMS over widths in the first steps, the paper's coordinate check).

    python -m lmlab.studies optim <sweep dir> [--target 2.2]
    python -m lmlab.studies lr_transfer <sweep dir>
    python -m lmlab.studies coord_check <sweep dir>

Each prints a markdown table and writes its picture into the sweep directory (or --out).
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmlab import names
from lmlab.compare import find_runs
from lmlab.plots import _plt, _save, read_metrics
from lmlab.rundir import RunDir


def _runs(sweep: str | Path) -> list[tuple[dict[str, Any], dict[str, list[tuple[int, float]]]]]:
    """(summary, metrics) of every finished run of the sweep."""
    out = []
    for run in find_runs(Path(sweep)):
        summary = RunDir(run).read_summary()
        if summary is not None and (run / "metrics.csv").is_file():
            out.append((summary, read_metrics(run / "metrics.csv")))
    return out


def _cfg(summary: dict[str, Any], key: str) -> Any:
    node: Any = summary["config"]
    for part in key.split("."):
        node = node[part]
    return node


def _mean_sd(values: Sequence[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.mean(values):.3f}" + (f" ± {statistics.stdev(values):.3f}" if len(values) > 1 else "")


def steps_to(series: list[tuple[int, float]], target: float) -> int | None:
    """The first validation step whose val loss is at or below `target` (None: never)."""
    return next((step for step, v in series if v <= target), None)


def state_bytes_per_param(summary: dict[str, Any]) -> float:
    """Bytes of optimizer state per parameter after one step, on the run's own model and optim config (the storages
    lmlab.bench's optim_state_bytes counts)."""
    import torch

    from lmlab.config import GPTConfig
    from lmlab.lit import configure_optimization
    from lmlab.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(**summary["model"]))
    opt = configure_optimization(model, summary["config"]["optim"], summary["config"]["schedule"], 10)["optimizer"]
    idx = torch.randint(0, model.cfg.vocab_size, (2, 16))
    model(idx, idx).backward()
    opt.step()
    tensors = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    return total / model.num_params()


def optim_table(sweep: str | Path, target: float | None = None, out: Path | None = None) -> str:
    """One row per optimizer, over seeds: lr, final val loss, the steps and tokens to `target` (default: the median
    of the optimizers' mean final losses, which some reach and some do not), the state bytes per parameter; the
    picture: every run's val loss curve."""
    by: dict[str, list] = defaultdict(list)
    for summary, series in _runs(sweep):
        by[_cfg(summary, "optim.name")].append((summary, series))
    finals = {k: [s["final_val_loss"] for s, _ in v if s.get("final_val_loss") is not None] for k, v in by.items()}
    if target is None:
        target = round(statistics.median(statistics.mean(f) for f in finals.values() if f), 2)
    lines = [f"target val loss {target}", "",
             "| optim | lr | final val loss | steps to target | tokens to target | state bytes / parameter |",
             "|---|---|---|---|---|---|"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    order = sorted(by, key=lambda k: statistics.mean(finals[k]) if finals[k] else math.inf)
    for name in order:
        runs = by[name]
        summary = runs[0][0]
        reached = [steps_to(series.get(names.VAL_LOSS, []), target) for _, series in runs]
        tokens_per_step = _cfg(summary, "data.batch_size") * _cfg(summary, "model.max_seq_len")
        hit = [r for r in reached if r is not None]
        steps = "not reached" if not hit else f"{statistics.mean(hit):.0f}" + (
            "" if len(hit) == len(reached) else f" ({len(hit)}/{len(reached)} seeds)")
        lines.append(f"| {name} | {_cfg(summary, 'optim.lr'):g} | {_mean_sd(finals[name])} | {steps} | "
                     f"{f'{statistics.mean(hit) * tokens_per_step / 1e3:.0f}k' if hit else '—'} | "
                     f"{state_bytes_per_param(summary):.2f} |")
        for i, (_, series) in enumerate(runs):
            xs, ys = zip(*series.get(names.VAL_LOSS, [(0, math.nan)]))
            ax.plot(xs, ys, color=f"C{order.index(name)}", label=name if i == 0 else None, alpha=0.8)
    ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="step", ylabel="val loss", title="optim_compare (each seed a line)")
    ax.legend(fontsize=8)
    _save(fig, (out or Path(sweep)) / "optim_compare_val_loss.png")
    return "\n".join(lines)


def lr_transfer(sweep: str | Path, out: Path | None = None) -> str:
    """Best val loss (mean over seeds) per (param, width, lr), the best lr of each width starred; the picture: loss
    against lr, one line per width, a panel per parametrisation."""
    grid: dict[tuple[str, int, float], list[float]] = defaultdict(list)
    for summary, _ in _runs(sweep):
        loss = summary.get("best_val_loss")
        key = (_cfg(summary, "param.name"), _cfg(summary, "model.d_model"), _cfg(summary, "optim.lr"))
        grid[key].append(loss if loss is not None and summary["status"] == "completed" else math.nan)
    params = sorted({k[0] for k in grid}, key=lambda p: p != "sp")
    widths, lrs = sorted({k[1] for k in grid}), sorted({k[2] for k in grid})
    lines = ["| param | d_model | " + " | ".join(f"lr {lr:g}" for lr in lrs) + " | best lr |",
             "|---|---|" + "---|" * (len(lrs) + 1)]
    plt = _plt()
    fig, axes = plt.subplots(1, len(params), figsize=(5 * len(params), 4), sharey=True, squeeze=False)
    for ax, param in zip(axes[0], params):
        for j, width in enumerate(widths):
            means = [statistics.mean(grid[(param, width, lr)]) if grid.get((param, width, lr)) else math.nan
                     for lr in lrs]
            finite = [m for m in means if math.isfinite(m)]
            best = lrs[means.index(min(finite))] if finite else None
            cells = [("—" if not math.isfinite(m) else f"**{m:.3f}**" if lr == best else f"{m:.3f}")
                     for m, lr in zip(means, lrs)]
            lines.append(f"| {param} | {width} | " + " | ".join(cells) + (f" | {best:g} |" if best else " | — |"))
            ax.plot([math.log2(lr) for lr in lrs], means, marker="o", color=plt.cm.viridis(j / max(1, len(widths) - 1)),
                    label=f"d_model {width}")
        ax.set(xlabel="log2 lr", title=f"param={param}")
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("best val loss (mean of seeds)")
    _save(fig, (out or Path(sweep)) / "lr_transfer.png")
    return "\n".join(lines)


def coord_check(sweep: str | Path, out: Path | None = None) -> str:
    """act/rms of the last block at each logged step against the width, a line per step, a panel per param (the
    coordinate check as the µP paper draws it); the table: the last step's RMS per width, and widest / narrowest."""
    data: dict[str, dict[int, dict[int, float]]] = defaultdict(dict)
    for summary, series in _runs(sweep):
        layers = sorted(k for k in series if re.fullmatch(r"act/rms/layer_\d+", k))
        if layers:
            data[_cfg(summary, "param.name")][_cfg(summary, "model.d_model")] = dict(series[layers[-1]])
    params = sorted(data, key=lambda p: p != "sp")
    widths = sorted({w for p in data.values() for w in p})
    steps = sorted({s for p in data.values() for w in p.values() for s in w})
    plt = _plt()
    fig, axes = plt.subplots(1, len(params), figsize=(5 * len(params), 4), sharey=True, squeeze=False)
    lines = ["| param | " + " | ".join(f"d_model {w}" for w in widths) + " | widest / narrowest |",
             "|---|" + "---|" * (len(widths) + 1)]
    for ax, param in zip(axes[0], params):
        for t in steps:
            ax.plot(widths, [data[param].get(w, {}).get(t, math.nan) for w in widths], marker="o",
                    color=plt.cm.plasma(t / max(1, steps[-1])), label=f"t={t}")
        ax.set(xscale="log", yscale="log", xlabel="width (d_model)", title=f"param={param}")
        ax.legend(fontsize=7, ncol=2)
        last = [data[param].get(w, {}).get(steps[-1], math.nan) for w in widths]
        lines.append(f"| {param} | " + " | ".join(f"{v:.3g}" for v in last) + f" | {last[-1] / last[0]:.2f}x |")
    axes[0][0].set_ylabel("act/rms of the last block")
    _save(fig, (out or Path(sweep)) / "mup_coord_check.png")
    return f"step {steps[-1]}\n\n" + "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lmlab.studies", description=__doc__.split("\n\n")[0])
    ap.add_argument("study", choices=["optim", "lr_transfer", "coord_check"])
    ap.add_argument("sweep")
    ap.add_argument("--target", type=float, default=None, help="optim: the val loss to reach (default: the median)")
    ap.add_argument("--out", type=Path, default=None, help="where the picture goes (default: the sweep directory)")
    args = ap.parse_args(argv)
    if args.study == "optim":
        print(optim_table(args.sweep, args.target, args.out))
    elif args.study == "lr_transfer":
        print(lr_transfer(args.sweep, args.out))
    else:
        print(coord_check(args.sweep, args.out))


if __name__ == "__main__":
    main()
