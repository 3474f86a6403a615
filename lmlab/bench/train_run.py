"""python -m lmlab.bench train: one `train.py` run as a user starts it, its throughput figures as JSON.

    python -m lmlab.bench train --name compiled --json out/train-compiled.json -- model=gpt2_124m compile=true

The run goes to a fresh directory (`--runs`/<name>, deleted first: a directory that holds a checkpoint would be
resumed), with the csv logger on; its output streams through. Afterwards its `summary.json` and `metrics.csv` give:
`tokens_per_s` and `mfu`, the median of the `perf/` values logged in the second half of the run (the first logged
window carries compilation and the first step's allocations), `max_memory_gib`, the peak `perf/max_memory` (the CUDA
allocator's peak on a GPU, the process's peak RSS on a CPU), and the run's status, steps, loss and parameter count.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lmlab import names
from lmlab.bench.report import write_json

ROOT = Path(__file__).resolve().parents[2]


def perf_figures(metrics_csv: Path) -> dict[str, Any]:
    """The `perf/` columns of a run's metrics.csv: medians over the second half of the logged rows, the peak memory,
    and the logged values themselves."""
    rows = list(csv.DictReader(metrics_csv.open())) if metrics_csv.is_file() else []
    logged = [r for r in rows if r.get(names.TOKENS_PER_S)]

    def values(key: str) -> list[float]:
        return [float(r[key]) for r in logged if r.get(key)]

    def steady(key: str) -> float | None:
        vals = values(key)
        return statistics.median(vals[len(vals) // 2:]) if vals else None

    memory = values(names.MAX_MEMORY)
    return {"tokens_per_s": steady(names.TOKENS_PER_S), "mfu": steady(names.MFU),
            "max_memory_gib": max(memory) if memory else None,
            "logged": {key: values(key) for key in (names.TOKENS_PER_S, names.MFU, names.MAX_MEMORY)},
            "logged_steps": [int(r["step"]) for r in logged]}


def train_run(name: str, overrides: list[str], runs: Path, limit: float | None = None) -> dict[str, Any]:
    """Run train.py with `overrides` in runs/<name>; its figures (perf_figures) and summary, whatever its exit."""
    run_dir = runs / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "train.py"), "logger=csv", f"hydra.run.dir={run_dir}", *overrides]
    start = time.perf_counter()
    try:
        rc = subprocess.run(cmd, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        rc = 124
    wall = time.perf_counter() - start
    summary_path = run_dir / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    keep = ("status", "steps", "tokens", "final_val_loss", "n_params", "n_active_params", "flops_per_token",
            "tokens_per_s", "wall_time_s", "world_size", "error")
    kept = {k: summary.get(k) for k in keep} | {k: summary[k] for k in ("fp8", "mixer_backend") if k in summary}
    return {"name": name, "overrides": overrides, "command": " ".join(cmd), "rc": rc, "wall_s": wall,
            "run_dir": str(run_dir), **perf_figures(run_dir / "metrics.csv"), "summary": kept}


def render(out: dict[str, Any]) -> str:
    s = out["summary"]

    def fmt(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    return (f"train.py {out['name']}: {s.get('status') or 'no summary'} (exit {out['rc']}, {out['wall_s']:.0f} s), "
            f"step {s.get('steps')}, val loss {fmt(s.get('final_val_loss'), '.4f')}; "
            f"{fmt(out['tokens_per_s'], ',.0f')} tok/s, MFU {fmt(out['mfu'], '.1%')}, "
            f"peak memory {fmt(out['max_memory_gib'], '.2f')} GiB")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m lmlab.bench train", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", required=True, help="the run's name: its directory under --runs, and the JSON's")
    p.add_argument("--runs", type=Path, default=Path("/tmp/lmlab-bench-runs"), help="where the run directories go")
    p.add_argument("--limit", type=float, default=None, help="seconds before train.py is stopped (exit 124)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("overrides", nargs="*", help="train.py's overrides (after --)")
    args = p.parse_args(argv)
    out = train_run(args.name, args.overrides, args.runs, args.limit)
    print(render(out), flush=True)
    write_json(args.json, out)
    if out["rc"] != 0:
        sys.exit(out["rc"])
    return out


if __name__ == "__main__":
    main()
