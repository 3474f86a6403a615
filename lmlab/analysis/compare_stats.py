"""compare's significance section: each variant against a baseline variant over the seeds they share.

compare_significance.{md,csv}: one row per variant other than the baseline, with the paired differences of
`FIGURE` (variant − baseline: negative is better), their 95% t interval, the p-value, Holm's over the sweep's
variants, whether the difference stands out of the seed noise at α = 0.05, and the seeds a paired test would need to
resolve the observed difference at the observed spread (lmlab.analysis.significance).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmlab.analysis.compare_seeds import seed_label
from lmlab.analysis.significance import holm, paired, seeds_needed, verdict
from lmlab.record.tables import write_table

FIGURE = "best_val_loss"
COLS = ("variant", "baseline", "n", "diff_mean", "diff_sd", "ci95_low", "ci95_high", "p", "p_holm",
        "distinguishable", "seeds_needed")


def variant_name(row: dict[str, Any], keys: Sequence[str]) -> str:
    return ",".join(f"{k}={row.get(k, '')}" for k in keys)


def pick_baseline(names: Sequence[str], baseline: str | Sequence[str] | None) -> str:
    """The baseline variant: the one `baseline` names, else the first. Each of its comma-separated items is a value
    (`mlp`: what the command line can say, `baseline=mlp`) or a `key=value` pair (`ffn=mlp`, from Python or quoted
    on the command line); every item must be in the variant's name."""
    if baseline is None:
        return names[0]
    items = baseline.split(",") if isinstance(baseline, str) else [str(b) for b in baseline]
    want = {i.strip() for i in items if i.strip()}

    def has(name: str) -> bool:
        pairs = set(name.split(","))
        return want <= pairs | {p.split("=", 1)[-1] for p in pairs}

    matches = [n for n in names if has(n)]
    if len(matches) != 1:
        raise ValueError(f"baseline={baseline!r} must name exactly one variant; the variants are {list(names)}"
                         + (f" ({len(matches)} match)" if matches else ""))
    return matches[0]


def significance(rows: Sequence[dict[str, Any]], keys: Sequence[str], stem: Path, baseline: str | None = None,
                 figure: str = FIGURE, within: Sequence[str] = ()) -> tuple[list[dict[str, Any]], str]:
    """The significance rows of per-run `rows` (each with its `keys`, `seed` and `figure`); writes stem.{md,csv}.
    `within`: keys whose values are compared apart (a ladder's sizes: each variant against the baseline at the same
    size); Holm's correction runs over every test of the section."""
    groups: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows:
        at = variant_name(row, within)
        per_seed = groups.setdefault(at, {}).setdefault(variant_name(row, keys), {})
        value = row.get(figure)
        if isinstance(value, (int, float)) and math.isfinite(value) and row.get("status") == "completed":
            per_seed[seed_label(row)] = float(value)  # paired by every seed key the runs set
    tests = {}
    for at, per_seed in groups.items():
        base = pick_baseline(list(per_seed), baseline)
        for name in per_seed:
            if name != base:
                tests[(at, name, base)] = paired(per_seed[base], per_seed[name])
    adjusted = dict(zip(tests, holm([t.p for t in tests.values()])))
    out = [{"variant": ",".join(filter(None, (name, at))), "baseline": base, "n": t.n, "diff_mean": t.mean,
            "diff_sd": t.sd, "ci95_low": t.low, "ci95_high": t.high, "p": t.p, "p_holm": adjusted[key],
            "distinguishable": verdict(t.n, adjusted[key]), "seeds_needed": seeds_needed(t.mean, t.sd)}
           for key, t in tests.items() for at, name, base in [key]]
    md = write_table(out, COLS, stem) if out else ""
    return out, md
