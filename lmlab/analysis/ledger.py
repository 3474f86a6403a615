"""`lmlab ledger <file>`'s table: a fixed-budget ledger's rows (lmlab.record.ledger) best first, each row's difference
to the best, and whether it is above the ledger's own noise floor.

The metric is val bpb when every completed row has one (comparable across tokenizers), else val loss; the table says
which. Only completed rows are ranked; diverged, collapsed, interrupted, failed and refused rows follow, with their
status and error.

The noise floor comes from the ledger itself: rows of one config (the same commit, the same edits to it, the same
overrides but for `seed`, `seeds.*` (lmlab.run.seeds) and keys that change no result, NEUTRAL) run at two or more
seeds are repeats. Their spread, pooled over every such config (σ² = Σ (nᵢ − 1)·sᵢ² / Σ (nᵢ − 1), sᵢ each config's
sample sd), is the seed noise of one run; the difference of two single runs has sd √2·σ, and a difference counts as
above the floor when it is more than two of those: floor = 2·√2·σ (about a two-sided 5% test). Without repeats there
is no floor, and the table says so instead of guessing one.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from lmlab.cli import override_key

METRICS = ("val_bpb", "val_loss")
# Override keys that do not make another config: the seeds (what repeats vary), where the row is written, and what
# changes how a run is watched or launched, not what it learns
NEUTRAL = ("seed", "seed.", "seeds.", "ledger", "hydra.", "logger", "logger.", "threads", "trainer.enable_progress_bar",
           "resume", "overwrite", "malloc", "perf.")
FLOOR_SDS = 2.0  # the floor in standard deviations of a two-run difference


def _number(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def config_key(r: Mapping[str, Any]) -> tuple:
    """What makes two rows the same config: the commit, its edits and the overrides less the NEUTRAL keys."""
    kept = sorted(o for o in r.get("overrides") or [] if not any(
        override_key(str(o)) == k or (k.endswith(".") and override_key(str(o)).startswith(k)) for k in NEUTRAL))
    return r.get("commit"), r.get("dirty"), tuple(kept)


def noise_floor(rows: Sequence[Mapping[str, Any]], metric: str) -> dict[str, Any] | None:
    """The pooled seed sd σ of `metric` over the repeated configs of `rows` and the floor 2·√2·σ (module docstring);
    None when no config was run at two seeds or more."""
    groups: dict[tuple, list[Mapping[str, Any]]] = defaultdict(list)
    for r in rows:
        if _number(r.get(metric)) is not None:
            groups[config_key(r)].append(r)
    ss, dof, configs, runs = 0.0, 0, 0, 0
    for members in groups.values():
        if len({json.dumps([r.get("seed"), r.get("seeds")], sort_keys=True) for r in members}) < 2:
            continue
        values = [float(r[metric]) for r in members]
        mean = sum(values) / len(values)
        ss += sum((v - mean) ** 2 for v in values)
        dof, configs, runs = dof + len(values) - 1, configs + 1, runs + len(values)
    if not dof:
        return None
    sigma = math.sqrt(ss / dof)
    return {"sigma": sigma, "floor": FLOOR_SDS * math.sqrt(2) * sigma, "configs": configs, "runs": runs}


def ranked(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The ledger's completed rows best first by its metric, each with `rank`, `diff` (to the best) and `above_floor`
    (None for the best and without a floor), the metric, why it, the floor, and the other rows in ledger order."""
    completed = [r for r in rows if r.get("status") == "completed"]
    with_bpb = [r for r in completed if _number(r.get("val_bpb")) is not None]
    metric = "val_bpb" if completed and len(with_bpb) == len(completed) else "val_loss"
    why = ("every completed row has val_bpb" if metric == "val_bpb" else
           "no row has val_bpb" if not with_bpb else f"{len(completed) - len(with_bpb)} completed row(s) lack val_bpb")
    scored = sorted((r for r in completed if _number(r.get(metric)) is not None), key=lambda r: float(r[metric]))
    floor = noise_floor(scored, metric)
    best = float(scored[0][metric]) if scored else None
    out = []
    for i, r in enumerate(scored, start=1):
        diff = float(r[metric]) - best
        above = None if floor is None or i == 1 else diff > floor["floor"]
        out.append({**r, "rank": i, "diff": diff, "above_floor": above})
    ids = {id(r) for r in scored}
    return {"metric": metric, "why": why, "floor": floor, "rows": out,
            "unranked": [dict(r) for r in rows if id(r) not in ids]}


def _fmt(value: Any, spec: str = ".4f") -> str:
    if _number(value) is None:
        return "-"
    return str(int(value)) if spec == "d" else format(float(value), spec)


def _aligned(lines: list[list[str]]) -> list[str]:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]


def table(result: Mapping[str, Any], source: str) -> str:
    """The text `lmlab ledger` prints: a heading line (metric, floor), the overrides every row has, the ranked rows
    (with the overrides they do not all share), then the rest."""
    metric, floor = result["metric"], result["floor"]
    said = (f"noise floor {floor['floor']:.4f} (2·√2·σ, σ {floor['sigma']:.4f} over {floor['configs']} repeated "
            f"config(s), {floor['runs']} runs)" if floor else "no floor (no repeated configs)")
    every = [*result["rows"], *result["unranked"]]
    common = set.intersection(*(set(map(str, r.get("overrides") or [])) for r in every)) if len(every) > 1 else set()

    def differing(r: Mapping[str, Any]) -> str:
        return " ".join(o for o in map(str, r.get("overrides") or []) if o not in common) or "-"

    lines = [f"{source}: {len(every)} row(s), ranked by {metric} ({result['why']}); {said}"]
    if common:
        lines.append(f"every row: {' '.join(sorted(common))}")
    if result["rows"]:
        cells = [["#", metric, "vs best", "floor", "steps", "params", "wall_s", "commit", "overrides"]]
        for r in result["rows"]:
            verdict = "-" if r["above_floor"] is None else "above" if r["above_floor"] else "below"
            cells.append([str(r["rank"]), _fmt(r[metric]), "best" if r["rank"] == 1 else f"{r['diff']:+.4f}",
                          verdict, _fmt(r.get("steps"), "d"), _fmt(r.get("params"), "d"), _fmt(r.get("wall_s"), ".1f"),
                          _commit(r), differing(r)])
        lines += ["  " + line for line in _aligned(cells)]
    if result["unranked"]:
        lines.append("not ranked:")
        cells = [["status", "steps", "overrides", "error"]]
        for r in result["unranked"]:
            error = " ".join(str(r.get("error") or "").split())
            cells.append([str(r.get("status")), _fmt(r.get("steps"), "d"), differing(r), error[:200] or "-"])
        lines += ["  " + line for line in _aligned(cells)]
    return "\n".join(lines)


def _commit(r: Mapping[str, Any]) -> str:
    """The commit's first 8 digits, `+<edits>` when its tracked files were edited."""
    commit = str(r.get("commit") or "-")[:8]
    return commit + (f"+{str(r['dirty'])[:6]}" if r.get("dirty") else "")
