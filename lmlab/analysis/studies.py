"""The optimizer, parametrisation and residual-stream studies read back: `optim_compare` (steps and tokens to a target
val loss, final loss at equal tokens, optimizer state per parameter), `lr_transfer` (the best lr per width under sp and
mup, the µP paper's Figure 1), `mup_coord_check` (activation RMS over widths in the first steps, the paper's
coordinate check), `speedrun_ladder` (the speedrun's records added one at a time: each row's final loss and steps to
the baseline's loss, its change from the row before with a paired test over seeds, beside the record's own gain) and
`residual_placement` (each residual option under each placement, deep and without warmup: trained or collapsed).

    python -m lmlab.analysis.studies optim <sweep dir> [--target 2.2]
    python -m lmlab.analysis.studies lr_transfer <sweep dir>
    python -m lmlab.analysis.studies coord_check <sweep dir>
    python -m lmlab.analysis.studies speedrun_ladder <sweep dir> [--target 1.9]
    python -m lmlab.analysis.studies residual_placement <sweep dir>
    python -m lmlab.analysis.studies optimizer_benchmark <sweep dir>   (lmlab/analysis/optimizer_benchmark.py)

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
from lmlab.analysis.compare import find_runs
from lmlab.analysis.significance import paired
from lmlab.record.plots import _plt, _save, read_metrics
from lmlab.record.rundir import RunDir
from lmlab.record.targets import crossing


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
    from lmlab.model.gpt import GPT
    from lmlab.run.lit import configure_optimization

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
    _finish_curves(fig, ax, target, "val loss", "optim_compare (each seed a line)",
                   (out or Path(sweep)) / "optim_compare_val_loss.png")
    return "\n".join(lines)


def _finish_curves(fig, ax, target: float | None, ylabel: str, title: str, path: Path) -> None:
    """A study's val-curve picture: the target as a dashed line, labels, legend, saved to `path`."""
    if target is not None:
        ax.axhline(target, color="grey", lw=0.8, ls="--")
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.legend(fontsize=8)
    _save(fig, path)


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


def _override(summary: dict[str, Any], key: str, default: str = "") -> str:
    return next((o.split("=", 1)[1] for o in summary.get("overrides", []) if o.startswith(f"{key}=")), default)


# The speedrun's record each row adds (modded-nanogpt's README, world record history: 8xH100 minutes to 3.28 FineWeb
# val loss, before -> after; a record's gain is its whole changelog's, of which the row takes the architecture).
SPEEDRUN_RECORDS = {
    "00_gpt2": "llm.c baseline: 45 min", "01_rope": "#2: 45 → 31.4 min (with 3× lr, trapezoidal schedule)",
    "02_muon": "#3: 31.4 → 24.9 min", "03_relu2_qknorm": "#5: 22.3 → 15.2 min (with zero-init projections, padding)",
    "04_untied": "#8: 12.0 → 10.8 min", "05_shortcuts": "#9: 10.8 → 8.2 min (with momentum warm-up)",
    "06_unet": "#11: 7.8 → 7.2 min (with 2× lr)", "07_value_embed": "#14: 4.66 → 4.41 min",
    "08_softcap15": "#18: 3.57 → 3.4 min", "09_untie_late": "#53: untied at 2/3 of training",
    "10_smear": "#34: 2.565 → 2.547 min", "11_backout": "#40: backout", "12_bigram_hash": "#62: bigram hash",
    "13_logit_rescale": "#54: asymmetric logit rescale", "14_xsa": "#82: learnable XSA",
    "15_key_offset": "#49: partial key offset", "16_zero_proj": "#5: 22.3 → 15.2 min (zero-init projections)",
    "17_sigmoid_skips": "#32: 2.656 → 2.625 min", "18_refine_skip": "#45: 2.269 → 2.248 min",
    "19_mlp_lr": "#42: 2.345 → 2.313 min", "20_mimetic_vo": "#64: 1.650 → 1.630 min",
    "21_drop_mlp": "#30: 2.731 → 2.717 min", "22_drop_attn": "#17: 3.80 → 3.57 min (one layer's attention)",
    "23_paired_heads": "#58: 1.878 → 1.820 min", "24_window_warmup": "#13: 5.03 → 4.66 min",
    "25_batch_schedule": "#46: 2.248 → 2.203 min", "26_seq_schedule": "#72: 1.516 → 1.496 min",
    "27_split_parts": "#4: 24.9 → 22.3 min", "28_wsd": "#19: 3.4 → 3.142 min",
    "29_sparse_gate": "#28: 2.817 → 2.812 min",
    "30_polar_express": "#38: 2.483 → 2.476 min", "31_adam_every": "#39: 2.476 → 2.447 min",
    "32_normuon": "#41: 2.358 → 2.345 min", "33_cautious_wd": "#43: 2.313 → 2.284 min",
    "34_mtp_logits": "#53: 2.037 → 1.988 min", "35_ve_gates": "#55: 1.940 → 1.918 min",
    "36_ve_untied": "#63: 1.655 → 1.650 min", "37_head_pairs": "#80: 1.411 → 1.406 min",
    "38_block_window": "#16: 3.95 → 3.80 min", "39_ve_layout": "#70: 1.528 → 1.521 min",
    "40_normuon_beta2": "#78: 1.435 → 1.426 min", "41_tied": "#87: 1.266 → 1.256 min (and #51's retie)",
    "42_cooldown45": "#26: 2.896 → 2.863 min (the cool-down alone)", "43_ve_shared": "#15: 4.41 → 3.95 min",
    "44_long_short": "#20: 3.142 → 2.992 min", "45_window_stages": "#29: 2.812 → 2.731 min (the windows' stages)",
    "46_eval_final": "#33: 2.592 → 2.565 min", "47_eval_long": "#35: 2.547 → 2.527 min (validation windows)",
    "48_muon_lr_mults": "#48: 2.193 → 2.170 min", "49_cautious_adam": "#50: 2.146 → 2.128 min",
    "50_smooth_scalars": "#52: 2.075 → 2.037 min (no pause at transitions)",
    "51_gates_adam": "#56: 1.918 → 1.894 min", "52_adam_betas": "#57: 1.894 → 1.878 min",
    "53_bigram_signs": "#83: 1.353 → 1.328 min", "54_bare_attention": "#74: 1.485 → 1.468 min",
    "55_smaller_batch": "#21: 2.992 → 2.933 min", "56_doc_mask": "#12: 7.2 → 5.03 min (the document mask alone)",
    "57_window_yarn": "#31: 2.717 → 2.656 min",
}


def speedrun_ladder(sweep: str | Path, target: float | None = None, out: Path | None = None) -> str:
    """One row per ladder step (its `speedrun_step`), in order: final val loss over seeds, its change from the row
    before (paired over seeds: mean and p), the steps to `target` (default: the first row's highest final loss over
    its seeds, which each of them reaches at its end and the later rows sooner or not), the record's own gain; the
    picture: each row's mean val curve."""
    by: dict[str, dict[str, tuple[dict, list]]] = defaultdict(dict)
    for summary, series in _runs(sweep):
        by[_override(summary, "speedrun_step", "?")][_override(summary, "seed", "0")] = (
            summary, series.get(names.VAL_LOSS, []))
    rows = sorted(by)
    finals = {r: {seed: s["final_val_loss"] for seed, (s, _) in by[r].items()
                  if s.get("status") == "completed" and s.get("final_val_loss") is not None} for r in rows}
    if target is None and rows and finals[rows[0]]:
        target = math.ceil(max(finals[rows[0]].values()) * 1000) / 1000  # each seed of the first row reaches it
    lines = [f"target val loss {target}", "",
             "| row | speedrun record | final val loss | Δ vs row before (p) | steps to target | status |",
             "|---|---|---|---|---|---|"]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, row in enumerate(rows):
        runs = by[row]
        hits = [crossing(curve, target) for _, curve in runs.values()] if target is not None else []
        reached = [h for h in hits if h is not None]
        steps = "—" if target is None else "not reached" if not reached else f"{statistics.mean(reached):.0f}" + (
            "" if len(reached) == len(hits) else f" ({len(reached)}/{len(hits)} seeds)")
        delta = "—"
        if i:
            test = paired(finals[rows[i - 1]], finals[row])
            if test.mean is not None:
                delta = f"{test.mean:+.3f}" + (f" (p={test.p:.2g})" if test.p is not None else "")
        status = ", ".join(sorted({s.get("status", "?") for s, _ in runs.values()}))
        lines.append(f"| {row} | {SPEEDRUN_RECORDS.get(row, '')} | {_mean_sd(list(finals[row].values()))} | {delta} | "
                     f"{steps} | {status} |")
        curves = [dict(curve) for _, curve in runs.values() if curve]
        steps_logged = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
        if steps_logged:
            ax.plot(steps_logged, [statistics.mean(c[s] for c in curves) for s in steps_logged], label=row,
                    color=plt.cm.viridis(i / max(1, len(rows) - 1)))
    _finish_curves(fig, ax, target, "val loss (mean over seeds)", "speedrun_ladder",
                   (out or Path(sweep)) / "speedrun_ladder_val_loss.png")
    return "\n".join(lines)


def residual_placement(sweep: str | Path, out: Path | None = None) -> str:
    """A grid of residual option (rows; `scaled` with branch_init=0 is ReZero) × placement (columns): each cell the
    run's final val loss, or how it ended (collapsed at step s, diverged); a pair refused by key has no run: —."""
    cells: dict[tuple[str, str], list[str]] = defaultdict(list)
    for summary, _ in _runs(sweep):
        residual = "+".join(summary["config"]["residual"])
        if _override(summary, "residual.scaled.branch_init") in ("0", "0.0"):
            residual = "scaled (ReZero: branch_init=0)"
        status, loss = summary.get("status"), summary.get("final_val_loss")
        cells[(residual, summary["config"]["placement"]["name"])].append(
            f"{loss:.3f}" if status == "completed" and loss is not None else f"{status} (step {summary.get('steps')})")
    placements = [p for p in ("pre", "post", "deepnorm") if any(k[1] == p for k in cells)]
    lines = ["| residual | " + " | ".join(placements) + " |", "|---|" + "---|" * len(placements)]
    for residual in sorted({k[0] for k in cells}, key=lambda r: (r != "standard", r)):
        lines.append(f"| {residual} | " + " | ".join(", ".join(cells.get((residual, p), ["—"]))
                                                 for p in placements) + " |")
    return "\n".join(lines + ["", "—: no run in the sweep (experiment=residual_placement leaves out the pairs refused "
                                   "by key: parallel and hyper under post and deepnorm, which normalise the sum)"])


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m lmlab.analysis.studies", description=__doc__.split("\n\n")[0])
    ap.add_argument("study", choices=["optim", "lr_transfer", "coord_check", "speedrun_ladder", "residual_placement",
                                          "optimizer_benchmark"])
    ap.add_argument("sweep")
    ap.add_argument("--target", type=float, default=None,
                    help="optim, speedrun_ladder: the val loss to reach (default: the median; the first row's)")
    ap.add_argument("--out", type=Path, default=None, help="where the picture goes (default: the sweep directory)")
    args = ap.parse_args(argv)
    if args.study == "optim":
        print(optim_table(args.sweep, args.target, args.out))
    elif args.study == "lr_transfer":
        print(lr_transfer(args.sweep, args.out))
    elif args.study == "speedrun_ladder":
        print(speedrun_ladder(args.sweep, args.target, args.out))
    elif args.study == "optimizer_benchmark":  # a section of compare's report (lmlab.analysis.optimizer_benchmark)
        from lmlab.analysis.compare import compare

        compare(args.sweep, out=args.out)
        print(((args.out or Path(args.sweep)) / "optimizer_benchmark.md").read_text())
    elif args.study == "residual_placement":
        print(residual_placement(args.sweep, args.out))
    else:
        print(coord_check(args.sweep, args.out))


if __name__ == "__main__":
    main()
