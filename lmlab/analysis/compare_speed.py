"""compare's speed section: whether a comparison by wall time or tokens/s measures the architecture or lmlab's
implementation of it.

A variant's runs are compared by their achieved model FLOP/s: tokens per second × train FLOPs per token
(lmlab.model.flops' count, what a FLOPs budget counts), which equal architectures' speeds at equal work. The
architecture decides how many FLOPs a token takes; the implementation decides how fast they go. A variant whose FLOP/s
is below IMPLEMENTATION_BOUND × the baseline variant's (`baseline=`, default: the first) is flagged
implementation-bound, naming the paths its config takes where lmlab is known to be slower than the kernel the field
runs it on (a windowed or document mask, an MoE's router and dispatch, a recurrent mixer on lmlab's PyTorch path): its
wall-time and tokens/s comparisons say more about that path than about the architecture. Its loss at equal steps,
tokens or FLOPs is unaffected.

compare_speed.{md,csv}: one row per variant: runs, device, tokens/s, FLOP/s (mean over its runs with a figure), ×
the baseline's, the flag and the paths. The flag also goes above every table (sweep.notes).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping
from typing import Any

from lmlab.analysis.compare_stats import pick_baseline
from lmlab.analysis.sections import Sweep, section
from lmlab.record.tables import write_table

IMPLEMENTATION_BOUND = 0.67  # below this fraction of the baseline's FLOP/s, the implementation sets the speed
COLS = ("variant", "runs", "device", "tokens_per_s", "model_flops_per_s", "vs_baseline", "implementation_bound",
        "paths")


def model_flops_per_s(summary: Mapping[str, Any]) -> float | None:
    """The run's achieved model FLOP/s: its summary's, else tokens/s × train FLOPs per token (a run of an older
    lmlab); None without both."""
    recorded = summary.get("model_flops_per_s")
    if _positive(recorded):
        return float(recorded)
    tokens, flops = summary.get("tokens_per_s"), summary.get("flops_per_token")
    return float(tokens) * float(flops) if _positive(tokens) and _positive(flops) else None


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def slow_paths(config: Mapping[str, Any], device: str | None, mixer_backend: str | None = None) -> list[str]:
    """The paths `config` (a run's resolved config) takes where lmlab's implementation, not the architecture, may set
    the speed, each named with the path it runs on `device` (the run's device type: cuda, cpu; None: unknown); a
    recurrent mixer's by the path the run recorded it ran (`mixer_backend`: torch, fla, ...), else by its key."""
    paths = []
    attention = config.get("attention") or {}
    masks = []
    if attention.get("window"):
        masks.append(f"window {attention['window']}")
    elif attention.get("pattern"):
        masks.append("a pattern of windows")
    if attention.get("doc_mask"):
        masks.append("documents")
    if attention.get("softcap"):
        masks.append(f"softcap {attention['softcap']}")
    if masks:
        kernel = {"cuda": "FlexAttention", "cpu": "lmlab's banded SDPA"}.get(device or "", "FlexAttention on CUDA, "
                                                                                         "banded SDPA on the CPU")
        paths.append(f"mask ({', '.join(masks)}): {kernel}")
    ffn = config.get("ffn") or {}
    if ffn.get("name") == "moe":
        paths.append(f"router (ffn=moe, {ffn.get('n_experts')} experts, top {ffn.get('top_k')}): routing and dispatch")
    mixer = config.get("mixer") or {}
    mixers = sorted({str(m) for m in [mixer.get("name"), *(mixer.get("pattern") or [])]} - {"attention", "None"})
    if mixers:
        ran = {"torch": "lmlab's PyTorch chunked path", "fla": "fla's kernels", "mamba_ssm": "mamba-ssm's kernel"}
        recorded = mixer_backend if isinstance(mixer_backend, str) else ""  # summary.json is data: any type
        forced = mixer.get("backend") not in (None, "auto", "torch")  # an older run: its key, not its path
        backend = ", ".join(ran.get(b, b) for b in recorded.split(",") if b) or (
            f"mixer.backend={mixer['backend']}" if forced else ran["torch"])
        paths.append(f"mixer ({', '.join(mixers)}): {backend}")
    return paths


@section(15)
def speed(sweep: Sweep) -> str:
    """The speed section (module docstring); empty when fewer than two variants have a FLOP/s figure."""
    keys = sweep.variant_keys
    groups: dict[str, list] = {}
    for run in sweep.runs:
        groups.setdefault(sweep.name(run, keys) if keys else "all runs", []).append(run)  # (seeds only: one)
    rows = []
    for name, runs in groups.items():
        figures = [(r, f) for r in runs if (f := model_flops_per_s(sweep.summaries[r])) is not None]
        if not figures:
            continue
        summary = sweep.summaries[figures[0][0]]
        device = summary.get("device")
        tokens = [t for r, _ in figures if _positive(t := sweep.summaries[r].get("tokens_per_s"))]
        rows.append({"variant": name, "runs": len(figures), "device": device or "",
                     "tokens_per_s": statistics.mean(tokens) if tokens else None,
                     "model_flops_per_s": statistics.mean(f for _, f in figures),
                     "paths": "; ".join(slow_paths(summary.get("config") or {}, device, summary.get("mixer_backend")))})
    if len(rows) < 2:
        return ""
    base_name = pick_baseline([r["variant"] for r in rows], sweep.baseline)
    base = next(r for r in rows if r["variant"] == base_name)
    for row in rows:
        row["vs_baseline"] = row["model_flops_per_s"] / base["model_flops_per_s"]
        row["implementation_bound"] = row["vs_baseline"] < IMPLEMENTATION_BOUND
        if row["implementation_bound"]:
            where = f": {row['paths']}" if row["paths"] else " (no path lmlab knows to be slow: see its profile)"
            sweep.notes.append(f"{row['variant']} runs at {row['vs_baseline']:.2f}x the FLOP/s of {base_name}, "
                               f"below {IMPLEMENTATION_BOUND}x: implementation-bound{where}; its wall-time and "
                               f"tokens/s comparisons measure lmlab's implementation, not the architecture")
    table = write_table(rows, COLS, sweep.dir / "compare_speed")
    return (f"\nAchieved model FLOP/s per variant against {base_name} (below {IMPLEMENTATION_BOUND}x: "
            f"implementation-bound)\n\n" + table)
