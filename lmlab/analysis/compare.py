"""`eval.py compare=<multirun dir>`: tables and plots over the runs of a sweep.

compare.{md,csv}: one row per run (the overrides that differ, status, figures). Runs that differ only by `seed` are
one variant: when the seed varies, compare_variants.{md,csv} has one row per variant with n, the seeds, the statuses
and the mean and sample sd (n − 1) of each figure over its seeds, and the curves plots draw each variant as its mean
with a ± sd band. When `optim.lr` varies, `best_lr` marks with * the row of each group of rows that share the other
overrides (an architecture) with the lowest objective: best val loss, +inf for a diverged, collapsed or unfinished run
(lmlab.record.summary.objective), over the mean of the seeds in the variants table.

Every run's steps, tokens, FLOPs and time to a target val loss (`target=`, default: the first of the runs' own
`targets` when they share them, else the highest best val loss of the sweep, which every run reached;
lmlab.record.targets)
are columns of both tables, and so is each run's val bits per byte (`final_val_bpb`, `best_val_bpb`): runs trained
with different tokenizers are ranked by it, best first, and their objective is it (lmlab.analysis.compare_tokenizers).
With seeds, compare_significance.{md,csv} tests each variant against a baseline variant (`baseline=key=value`,
default: the first) over their shared seeds (lmlab.analysis.compare_stats). A ladder (runs that differ by model size
or budget) gets its scaling fits, L(C) and, where it varies both N and D, L(N, D) (lmlab.analysis.ladder).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmlab import names
from lmlab.analysis import compare_noise, compare_seeds, compare_speed, optimizer_benchmark, retrieval  # noqa: F401
from lmlab.analysis.compare_gaps import CURVES, gaps, validations
from lmlab.analysis.compare_seeds import seed_label
from lmlab.analysis.compare_stats import significance
from lmlab.analysis.compare_tokenizers import ranked_by
from lmlab.analysis.ladder import matmul_weights, size_keys  # its own section registers with it
from lmlab.analysis.sections import LR, SECTIONS, SEEDS, SWEEP, Sweep, section
from lmlab.data.tasks import TASKS
from lmlab.record.plots import layer_profile, plot_curves, plot_expert_load, plot_init_profile, read_metrics
from lmlab.record.rundir import CHECKPOINTS, LOCK, METRICS, SUMMARY, RunDir, RunLock, atomic_write
from lmlab.record.summary import objective, side
from lmlab.record.tables import _fmt, write_table  # noqa: F401  (write_table: public here, as before)
from lmlab.record.targets import TARGET_FIGURES, default_target, to_target

FIGURES = ("final_val_loss", "best_val_loss", "final_val_bpb", "best_val_bpb", "loss_vs_unigram", "peak_grad_norm",
           "tokens_per_s", *TARGET_FIGURES)  # over seeds (a figure to target: over the seeds that reached it)


def find_runs(sweep_dir: Path) -> list[Path]:
    """Every run directory under `sweep_dir`: finished ones (summary.json) and those a killed or still running job
    left (metrics, checkpoints or a lock, but no summary yet)."""
    marks = (SUMMARY, METRICS, LOCK, f"{CHECKPOINTS}/last.ckpt")
    found = {p.parent for mark in marks for p in sweep_dir.rglob(Path(mark).name)
             if "wandb" not in p.parts and "eval" not in p.relative_to(sweep_dir).parts[:-1]}
    return sorted({r.parent if r.name == CHECKPOINTS else r for r in found})  # a run has marks in both


def _incomplete(run: Path) -> dict[str, Any]:
    """What a run without a summary shows: its state (running / killed) and the last step in metrics.csv."""
    series = read_metrics(run / METRICS) if (run / METRICS).exists() else {}
    steps = max((s for points in series.values() for s, _ in points), default=None)
    vals, bpbs = series.get(names.VAL_LOSS, []), series.get(names.VAL_BPB, [])
    return {"status": RunDir(run).state(), "steps": steps, "final_val_loss": vals[-1][1] if vals else None,
            "best_val_loss": min(v for _, v in vals) if vals else None, "overrides": [],
            **({"final_val_bpb": bpbs[-1][1], "best_val_bpb": min(v for _, v in bpbs)} if bpbs else {})}


def _overrides(summary: dict[str, Any]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in summary.get("overrides", []) if "=" in o and not o.startswith("hydra"))


_NUMBERS = ("steps", "diverged_at_step", "n_params", "final_val_loss", "best_val_loss", "unigram_val_loss",
            "peak_grad_norm", "tokens_per_s", "final_val_bpb", "best_val_bpb")


def _malformed(summary: dict[str, Any]) -> str | None:
    """Why a summary.json that reads as an object cannot be compared (None: it can): no status, overrides that are
    not strings, figures that are not finite numbers or null."""
    if not isinstance(summary.get("status"), str):
        return "summary.json has no status"
    if not isinstance(summary.get("overrides", []), list) or not all(
            isinstance(o, str) for o in summary.get("overrides", [])):
        return "summary.json's overrides are not a list of strings"
    for key in _NUMBERS:
        value = summary.get(key)
        if value is None:
            continue
        try:
            finite = not isinstance(value, bool) and math.isfinite(float(value))
        except (TypeError, ValueError, OverflowError):  # float(10**400) overflows
            finite = False
        if not finite:
            return f"summary.json's {key}={str(value)[:40]!r} is not a finite number"
    if not isinstance(summary.get("grad_norm_at_init") or {}, dict):
        return "summary.json's grad_norm_at_init is not an object"
    return None


def _read(run: Path) -> dict[str, Any]:
    """A run's summary for the table: its own, what a run without one shows, or a flagged stand-in for one that
    cannot be read or compared (the rest of the sweep is compared all the same)."""
    try:
        summary = RunDir(run).read_summary()
    except ValueError as err:  # not JSON, or not an object
        return {"status": "malformed", "problem": str(err).removeprefix(f"{run / SUMMARY} "), "overrides": []}
    if summary is None:
        return _incomplete(run)
    if (problem := _malformed(summary)) is not None:
        return {"status": "malformed", "problem": problem, "overrides": []}
    return summary


def mark_best_lr(rows: Sequence[dict[str, Any]], values: Sequence[float], others: Sequence[str]) -> None:
    """rows[i]["best_lr"] = "*" on the row with the lowest values[i] among the rows that share the `others` keys, ""
    elsewhere; no star in a group of one row (nothing was compared: an Optuna search varies every key) or where every
    value is +inf."""
    best: dict[tuple, int] = {}
    size: dict[tuple, int] = {}
    for i, row in enumerate(rows):
        key = tuple(row.get(k) for k in others)
        size[key] = size.get(key, 0) + 1
        if math.isfinite(values[i]) and (key not in best or values[i] < values[best[key]]):
            best[key] = i
    starred = {i for key, i in best.items() if size[key] > 1}
    for i, row in enumerate(rows):
        row["best_lr"] = "*" if i in starred else ""


def param_counts(summary: dict[str, Any]) -> dict[str, int | None]:
    """The run's parameters (`n_params`, from its summary), its FFNs' (`ffn_params`, all layers), so a sweep over
    `ffn` shows the variants' match, and its train FLOPs per token (`flops_per_token`: the summary's, else
    lmlab.model.flops' count on the rebuilt model). The FFNs are counted on the run's model rebuilt on the meta device;
    None
    when it cannot be rebuilt or the rebuilt total differs (a run sized by an older rule). `n_active_params`: the
    weights one token uses (an MoE's chosen experts), the summary's or the rebuilt model's. `n_matmul`: N of the 6·N
    count (lmlab.model.flops.matmul_params), the budget's record or the rebuilt model's: the N of a ladder's L(N, D)
    fit."""
    import torch

    from lmlab.config import GPTConfig
    from lmlab.model.capabilities import Sublayer
    from lmlab.model.flops import flops_per_token, matmul_params
    from lmlab.model.gpt import GPT
    from lmlab.model.memory import check_model_fits

    total, ffn, active = summary.get("n_params"), None, summary.get("n_params")
    n_matmul = matmul_weights(summary)
    flops = summary.get("flops_per_token")
    if isinstance(summary.get("model"), dict):
        try:
            cfg = GPTConfig(**summary["model"])
            check_model_fits(cfg, what="compare")  # a crafted or damaged summary could ask for a build of hours
            with torch.device("meta"):
                model = GPT(cfg)
        except (TypeError, ValueError, KeyError, OverflowError):
            model = None
        if model is not None and (total is None or model.num_params() == total):
            total = model.num_params()
            ffn = sum(p.numel() for m in model.modules() if isinstance(m, Sublayer) and m.sublayer == "ffn"
                      for p in m.parameters())
            active = model.num_params(active=True)
            flops = flops or flops_per_token(model, cfg.max_seq_len)["train"]
            n_matmul = n_matmul or matmul_params(model)
    return {"n_params": total, "ffn_params": ffn, "n_active_params": summary.get("n_active_params", active),
            "flops_per_token": flops, "n_matmul": n_matmul}


def _sort_key(value: str) -> tuple:
    try:
        return (0, float(value), value)
    except ValueError:
        return (1, 0.0, value)


def variants(rows: Sequence[dict[str, Any]], values: Sequence[float], keys: Sequence[str]
             ) -> tuple[list[dict[str, Any]], list[float]]:
    """One row per variant (the rows that share `keys`, i.e. differ only by seed): n, seeds, statuses, the mean, the
    sd and the 95% confidence half-width of the mean (`_ci95`) of each figure over the seeds that have it; and each variant's objective (the mean of its runs')."""
    groups: dict[tuple, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(tuple(row.get(k) for k in keys), []).append(i)
    out, objectives = [], []
    for key, members in groups.items():
        runs = [rows[i] for i in members]
        statuses = [r["status"] for r in runs]
        counts = {s: statuses.count(s) for s in dict.fromkeys(statuses)}
        row = {**dict(zip(keys, key)), "n": len(runs),
               "seeds": ",".join(sorted((seed_label(r) for r in runs), key=_sort_key)),
               "status": statuses[0] if len(counts) == 1 else ", ".join(f"{s} {c}" for s, c in counts.items()),
               "n_params": runs[0].get("n_params"), "n_active_params": runs[0].get("n_active_params"),
               "ffn_params": runs[0].get("ffn_params")}
        for fig in FIGURES:
            xs = [float(r[fig]) for r in runs if isinstance(r.get(fig), (int, float)) and math.isfinite(r[fig])]
            row[f"{fig}_mean"] = statistics.fmean(xs) if xs else None
            row[f"{fig}_sd"] = statistics.stdev(xs) if len(xs) > 1 else None
            row[f"{fig}_ci95"] = ci95(xs)
        out.append(row)
        objectives.append(statistics.fmean(values[i] for i in members))  # +inf if any seed failed
    return out, objectives


def ci95(xs: Sequence[float]) -> float | None:
    """The half-width of the 95% confidence interval of the mean of `xs` (Student's t, n - 1 degrees of freedom)."""
    if len(xs) < 2:
        return None
    from scipy import stats

    return float(stats.t.ppf(0.975, len(xs) - 1) * statistics.stdev(xs) / math.sqrt(len(xs)))


def _mean_sd(row: dict[str, Any], col: str) -> str:
    if col not in FIGURES:
        return _fmt(row.get(col))
    mean, sd = row.get(f"{col}_mean"), row.get(f"{col}_sd")
    return _fmt(mean) if sd is None else f"{_fmt(mean)} ± {sd:.2g}" if abs(sd) < 100 else f"{_fmt(mean)} ± {sd:.0f}"


def sweep_dirs(sweep_dir: str | Path | Sequence[str | Path]) -> list[Path]:
    """compare='s one directory, or its list of them."""
    return [Path(sweep_dir)] if isinstance(sweep_dir, (str, Path)) else [Path(d) for d in sweep_dir]


def output_dir(dirs: Sequence[Path], out: str | Path | None = None) -> Path:
    """Where compare writes: `out`, else the sweep directory, else (several sweeps) `<first>/vs_<the others' names>`."""
    if out:
        return Path(out)
    return dirs[0] if len(dirs) == 1 else dirs[0] / ("vs_" + "_".join(sweep_labels(dirs)[1:]))


def sweep_labels(dirs: Sequence[Path]) -> list[str]:
    """Each sweep's name in the tables (`sweep` column): its directory's name, with its parent's when two share it."""
    names = [d.resolve().name for d in dirs]
    if len(set(names)) < len(names):
        names = [f"{d.resolve().parent.name}_{d.resolve().name}" for d in dirs]
    return [n if names.count(n) == 1 else f"{n}_{i}" for i, n in enumerate(names)]


def compare(sweep_dir: str | Path | Sequence[str | Path], baseline: str | None = None, target: float | None = None,
            out: str | Path | None = None) -> tuple[list[dict[str, Any]], str]:
    """Rows (one per run) with the overrides that differ between runs; writes compare.{md,csv}, plots/ and, when the
    seed varies, compare_variants.{md,csv} and compare_significance.{md,csv} (against `baseline`, a `key=value[,...]`
    naming one variant). Several sweep directories are one comparison, each run keyed by its overrides and its sweep
    (`sweep=<its directory's name>`), written to `out` (default `<first>/vs_<the others>`). `target`: the val loss
    the *_to_target columns count to (None: the runs' first configured target, else the sweep's highest best val
    loss). Returns the rows and the markdown of the tables."""
    dirs = sweep_dirs(sweep_dir)
    sweep_dir, root = output_dir(dirs, out), Path(os.path.commonpath([d.resolve() for d in dirs]))
    found = {d: find_runs(d) for d in dirs}
    for d, runs in found.items():
        if not runs:
            raise FileNotFoundError(f"compare={d}: no run directories (with summary.json) under it")
    runs = [r for rs in found.values() for r in rs]
    summaries = {r: _read(r) for r in runs}
    overrides = {r: _overrides(s) for r, s in summaries.items()}
    if len(dirs) > 1:  # the sweep a run came from is one of its keys: a baseline sweep against a new one
        for d, label in zip(dirs, sweep_labels(dirs)):
            for r in found[d]:
                overrides[r][SWEEP] = label
    keys = sorted({k for o in overrides.values() for k in o})
    varying = [k for k in keys if len({o.get(k) for o in overrides.values()}) > 1] or keys
    varying.sort(key=lambda k: (k != SWEEP, k == LR, k in SEEDS))  # the sweep, the architecture, its lr, the seed
    order = dict(zip(sweep_labels(dirs), range(len(dirs)))) if len(dirs) > 1 else {}  # the sweeps as given
    runs = sorted(runs, key=lambda r: [(order[overrides[r][k]],) if k == SWEEP else _sort_key(overrides[r].get(k, ""))
                                       for k in varying])  # by value: lr 1e-3 < 1e-2; the first sweep's runs first
    figure, said = ranked_by(summaries.values())  # bits per byte across tokenizers (lmlab.analysis.compare_tokenizers)
    if said:
        runs = sorted(runs, key=lambda r: objective(summaries[r], figure))  # best first; ties in the order above
    summaries = {r: summaries[r] for r in runs}
    for r, s in summaries.items():
        if RunLock.holder(r) is not None:
            s["status"] = "running"  # a resumed run still going has the previous attempt's summary
    rows = []
    for r, s in summaries.items():
        unigram = s.get("unigram_val_loss")
        final = s.get("final_val_loss")
        rows.append({
            **{k: overrides[r].get(k, "") for k in varying},
            "status": s["status"], "diverged_at_step": s.get("diverged_at_step"), "steps": s.get("steps"),
            **param_counts(s),
            "final_val_loss": final, "best_val_loss": s.get("best_val_loss"),
            "final_val_bpb": s.get("final_val_bpb"), "best_val_bpb": s.get("best_val_bpb"),
            "loss_vs_unigram": final - unigram if final is not None and unigram is not None else None,
            "peak_grad_norm": s.get("peak_grad_norm"), "tokens_per_s": s.get("tokens_per_s"),
            "run": os.path.relpath(r.resolve(), root), "problem": s.get("problem", ""),
        })
    configured = [(s.get("config") or {}).get("targets") or [] for s in summaries.values()]
    target = default_target([row["best_val_loss"] for row in rows], configured) if target is None else float(target)
    for r, row in zip(runs, rows):  # the run's val_curve, else (an older run) its metrics.csv
        curve = isinstance(summaries[r].get("val_curve"), list)
        series = read_metrics(r / METRICS) if not curve and (r / METRICS).exists() and target is not None else {}
        row.update(to_target(series, summaries[r], target, row["flops_per_token"]) if target is not None and (
            curve or series) else dict.fromkeys(TARGET_FIGURES))
    values = [objective(s, figure) for s in summaries.values()]
    by_lr = ["best_lr"] if LR in varying else []
    if by_lr:
        mark_best_lr(rows, values, [k for k in varying if k != LR])
    routes = any(row["n_active_params"] != row["n_params"] for row in rows)  # MoE runs: fewer weights per token
    active_col = ["n_active_params"] if routes else []
    bpb_cols = ["final_val_bpb", "best_val_bpb"] if any(row["final_val_bpb"] is not None for row in rows) else []
    cols = [*varying, *by_lr, "status", "diverged_at_step", "steps", "n_params", *active_col, "ffn_params",
            "final_val_loss", "best_val_loss", *bpb_cols, "loss_vs_unigram", "peak_grad_norm", "tokens_per_s",
            "flops_per_token", *TARGET_FIGURES, "run",
            *(["problem"] if any(row["problem"] for row in rows) else [])]
    table = write_table(rows, cols, sweep_dir / "compare")
    md = (f"Target val loss for *_to_target: {_fmt(target)}\n\n" if target is not None else "") + table

    sweep = Sweep(sweep_dir, runs, summaries, overrides, varying, rows, values, target, baseline, by_lr, active_col,
                  notes=[said] if said else [], ranked_by=figure)
    for _, _, fn in SECTIONS:  # each study's or figure's own (lmlab.analysis.sections)
        md += fn(sweep)
    if sweep.notes:  # above the tables, printed and in compare.md
        said = "".join(f"Note: {n}\n" for n in sweep.notes) + "\n"
        md = said + md
        atomic_write(sweep_dir / "compare.md", said + table)
    return rows, md


# --- the sections every sweep may have (lmlab.analysis.sections); the ladder registers its own (in ladder.py) ---

@section(10)
def seeds(sweep: Sweep) -> str:
    """With the seed varying: one row per variant (mean ± sd over seeds), and each variant paired against the
    baseline over shared seeds."""
    if not any(k in SEEDS for k in sweep.varying):
        return ""
    keys = sweep.variant_keys
    grouped, group_values = variants(sweep.rows, sweep.values, keys)
    if sweep.by_lr:
        mark_best_lr(grouped, group_values, [k for k in keys if k != LR])
    head = [*keys, *sweep.by_lr, "n", "seeds", "status", "n_params", *sweep.active_col, "ffn_params"]
    figures = [f for f in FIGURES if "bpb" not in f or any(r.get(f) is not None for r in sweep.rows)]  # runs with bpb
    md = "\nPer variant (runs that differ only by seed): mean ± sd over seeds\n\n" + write_table(
        grouped, [*head, *(f"{f}_{m}" for f in figures for m in ("mean", "sd", "ci95"))],
        sweep.dir / "compare_variants", md_cols=[*head, *figures], md_cell=_mean_sd)
    sizes = size_keys(keys)
    if len(grouped) > 1 and len(keys) > len(sizes):
        _, sig = significance(sweep.rows, [k for k in keys if k not in sizes], sweep.dir / "compare_significance",
                              sweep.baseline, figure=sweep.ranked_by, within=sizes)
        what = sweep.ranked_by.replace("_", " ")  # best val loss; best val bpb across tokenizers
        md += f"\nPaired against the baseline over shared seeds ({what}, variant − baseline)\n\n" + sig
    return md


@section(20)
def curves(sweep: Sweep) -> str:
    """The training and validation loss and the gradient norm over steps (a variant's seeds as their mean ± sd), and
    a note for each plot or column the runs' validations could not fill."""
    series: dict[str, list] = {}
    for r, metrics in sweep.logged.items():  # the seeds of a variant share its name
        series.setdefault(sweep.name(r, sweep.variant_keys), []).append(metrics)
    plots = sweep.dir / "plots"
    drawn = {metric: plot_curves(series, metric, plots / png, log=metric == names.GRAD_NORM, title=title)
             for (metric, png), title in zip(CURVES.items(), ("training loss", "validation loss",
                                                                "global gradient norm (before clipping)"))}
    sweep.notes += gaps(drawn, [validations(s, sweep.logged.get(r, {})) for r, s in sweep.summaries.items()],
                        sweep.target)
    return ""


@section(30)
def expert_load(sweep: Sweep) -> str:
    """An MoE's expert load by layer and step, one panel per run whose summary says it routes (its side channel's
    `moe` figures)."""
    routed = [r for r, s in sweep.summaries.items() if names.MOE in side(s, sweep.logged.get(r))["figures"]]
    if routed:
        plot_expert_load({sweep.name(r, sweep.varying): sweep.logged[r] for r in routed if r in sweep.logged},
                         sweep.dir / "plots" / "expert_load.png")
    return ""


@section(40)
def init_profiles(sweep: Sweep) -> str:
    """The gradient norm per layer at init, and the blocks' Jacobian norms at their first and last measurement
    (jacobian.every_n_steps)."""
    plots = sweep.dir / "plots"
    profiles = {sweep.name(r, sweep.varying): s["grad_norm_at_init"] for r, s in sweep.summaries.items()
                if s.get("grad_norm_at_init")}
    if profiles:
        plot_init_profile(profiles, plots / "grad_norm_at_init.png")
    for at, stem, when in (("first", "jacobian_norms", "at its first measurement (step 0: init)"),
                           ("last", "jacobian_norms_end", "at its last measurement")):
        jac = {sweep.name(r, sweep.varying): p for r, m in sweep.logged.items()
               if (p := layer_profile(m, names.JAC_NORM, at))}
        if jac:
            plot_init_profile(jac, plots / f"{stem}.png", ylabel="‖∂x_l+1/∂x_l‖ / √n (RMS gain)",
                              title=f"Block Jacobian per layer, {when}")
    return ""


@section(70)
def tasks(sweep: Sweep) -> str:
    """A task's own tables and plots (data=position_probe: its accuracy per position)."""
    return "".join(task.compare_section(sweep.dir, sweep.runs, sweep.overrides, sweep.variant_keys)
                   for task in dict.fromkeys(TASKS.values()))
