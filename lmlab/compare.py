"""`eval.py compare=<multirun dir>`: one table and a set of plots over the runs of a sweep."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmlab.plots import plot_curves, plot_init_profile, read_metrics
from lmlab.rundir import CHECKPOINTS, LOCK, METRICS, SUMMARY, RunDir, RunLock, atomic_write


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return "" if v is None else str(v)


def write_table(rows: Sequence[dict[str, Any]], cols: Sequence[str], stem: Path) -> str:
    """Write stem.md and stem.csv; return the markdown."""
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |" for r in rows]
    md = "\n".join(lines) + "\n"
    atomic_write(stem.with_suffix(".md"), md)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(cols), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(stem.with_suffix(".csv"), buf.getvalue())
    return md


def find_runs(sweep_dir: Path) -> list[Path]:
    """Every run directory under `sweep_dir`: finished ones (summary.json) and those a killed or still running job
    left (metrics, checkpoints or a lock, but no summary yet)."""
    marks = (SUMMARY, METRICS, LOCK, f"{CHECKPOINTS}/last.ckpt")
    found = {p.parent for mark in marks for p in sweep_dir.rglob(Path(mark).name)
             if "wandb" not in p.parts and "eval" not in p.relative_to(sweep_dir).parts[:-1]}
    return sorted(r.parent if r.name == CHECKPOINTS else r for r in found)


def _incomplete(run: Path) -> dict[str, Any]:
    """What a run without a summary shows: its state (running / killed) and the last step in metrics.csv."""
    series = read_metrics(run / METRICS) if (run / METRICS).exists() else {}
    steps = max((s for points in series.values() for s, _ in points), default=None)
    vals = series.get("val/loss", [])
    return {"status": RunDir(run).state(), "steps": steps, "final_val_loss": vals[-1][1] if vals else None,
            "best_val_loss": min(v for _, v in vals) if vals else None, "overrides": []}


def _overrides(summary: dict[str, Any]) -> dict[str, str]:
    return dict(o.split("=", 1) for o in summary.get("overrides", []) if "=" in o and not o.startswith("hydra"))


def compare(sweep_dir: str | Path) -> tuple[list[dict[str, Any]], str]:
    """Rows (one per run) with the overrides that differ between runs; writes compare.{md,csv} and plots/."""
    sweep_dir = Path(sweep_dir)
    runs = find_runs(sweep_dir)
    if not runs:
        raise FileNotFoundError(f"compare={sweep_dir}: no run directories (with summary.json) under it")
    summaries = {r: RunDir(r).read_summary() or _incomplete(r) for r in runs}
    for r, s in summaries.items():
        if RunLock.holder(r) is not None:
            s["status"] = "running"  # a resumed run still going has the previous attempt's summary
    overrides = {r: _overrides(s) for r, s in summaries.items()}
    keys = sorted({k for o in overrides.values() for k in o})
    varying = [k for k in keys if len({o.get(k) for o in overrides.values()}) > 1] or keys
    rows = []
    for r, s in summaries.items():
        unigram = s.get("unigram_val_loss")
        final = s.get("final_val_loss")
        rows.append({
            **{k: overrides[r].get(k, "") for k in varying},
            "status": s["status"], "diverged_at_step": s.get("diverged_at_step"), "steps": s.get("steps"),
            "final_val_loss": final, "best_val_loss": s.get("best_val_loss"),
            "loss_vs_unigram": final - unigram if final is not None and unigram is not None else None,
            "peak_grad_norm": s.get("peak_grad_norm"), "tokens_per_s": s.get("tokens_per_s"),
            "run": str(r.relative_to(sweep_dir)),
        })
    cols = [*varying, "status", "diverged_at_step", "steps", "final_val_loss", "best_val_loss", "loss_vs_unigram",
            "peak_grad_norm", "tokens_per_s", "run"]
    md = write_table(rows, cols, sweep_dir / "compare")

    names = {r: ",".join(f"{k}={overrides[r].get(k, '')}" for k in varying) or r.name for r in runs}
    series = {names[r]: read_metrics(r / "metrics.csv") for r in runs if (r / "metrics.csv").exists()}
    plots = sweep_dir / "plots"
    plot_curves(series, "train/loss", plots / "train_loss.png", title="training loss")
    plot_curves(series, "val/loss", plots / "val_loss.png", title="validation loss")
    plot_curves(series, "grad/norm", plots / "grad_norm.png", log=True, title="global gradient norm (before clipping)")
    profiles = {names[r]: s["grad_norm_at_init"] for r, s in summaries.items() if s.get("grad_norm_at_init")}
    if profiles:
        plot_init_profile(profiles, plots / "grad_norm_at_init.png")
    return rows, md
