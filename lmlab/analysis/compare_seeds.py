"""compare's seeds section: for each variant of several runs, which of its seeds varied among them, so a reader knows
whether its spread is init luck, data-order luck or both.

A run's seeds are its effective ones (summary.json's `config.seeds`, lmlab.run.seeds; a run from before the split:
its `seed` for the init and the data, and a dropout stream that follows the init). A variant is the runs that share
every varying key but the seed keys (`seed`, `seeds.init`, `seeds.data`, `seeds.dropout`: lmlab.run.seeds.OVERRIDES).
For each variant of two or more runs, compare_seeds.{md,csv} has a row: the values of each seed over its runs, what
varied (`init`, `data`, `dropout`; `seed` where the runs differ by `seed` alone, which moves all three together) and
what the spread measures. The dropout stream varies where its seeds differ, or where it follows the init (no
seeds.dropout) and the init seeds differ: `dropout (follows init)`, whose luck is nil in a model without dropout or
layer drop. Variants whose spreads vary different seeds get a note above the tables: their sds measure different
noise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lmlab.analysis.sections import Sweep, section
from lmlab.record.tables import write_table
from lmlab.run.seeds import KEYS, OVERRIDES, Seeds, recorded

COLS = ("variant", "runs", "init", "data", "dropout", "varied", "spread")
FOLLOWS = "follows init"  # a dropout stream that continues the init's (no seeds.* key set)
LUCK = {"init": "init", "data": "data-order", "dropout": "dropout"}


def seed_label(row: Mapping[str, Any]) -> str:
    """A run's seeds as its overrides set them, the key that pairs it with the runs of other variants: the value of
    `seed` when that is the only one (`3`, as compare always wrote it), else `seed=3 seeds.data=2`; "" for none."""
    given = {k: row[k] for k in OVERRIDES if row.get(k) not in (None, "")}
    if list(given) == ["seed"]:
        return str(given["seed"])
    return " ".join(f"{k}={v}" for k, v in given.items())


def varied(seeds: Sequence[Seeds]) -> list[str]:
    """The seeds (of KEYS, in order) that take more than one value over `seeds`, the dropout stream by what it is: its
    own seed, or the init's it follows."""
    streams = {"init": {s.init for s in seeds}, "data": {s.data for s in seeds},
               "dropout": {(FOLLOWS, s.init) if s.dropout is None else s.dropout for s in seeds}}
    return [k for k in KEYS if len(streams[k]) > 1]


def _values(xs: Sequence[Any]) -> str:
    distinct = list(dict.fromkeys(xs))
    return ",".join(str(x) for x in sorted(distinct, key=lambda x: (isinstance(x, str), x)))


def spread(moved: Sequence[str], by_seed: bool = False) -> str:
    """What a spread over runs whose `moved` seeds varied measures."""
    if not moved:
        return "none: the runs share every seed (what differs is the machine's nondeterminism)"
    luck = [LUCK[k] for k in moved]
    said = luck[0] if len(luck) == 1 else ", ".join(luck[:-1]) + " and " + luck[-1]
    return f"{said} luck" + (" together (`seed` moves them all)" if by_seed else "")


def varied_label(moved: Sequence[str], seeds: Sequence[Seeds], by_seed: bool = False) -> str:
    """`moved` as the table says it: `seed (init, data, dropout)` for runs that differ by `seed` alone, the dropout
    stream marked where it follows the init, `none` for nothing."""
    if by_seed:
        return "seed (init, data, dropout)"
    follows = all(s.dropout is None for s in seeds)
    return ", ".join(f"{k} ({FOLLOWS})" if k == "dropout" and follows else k for k in moved) or "none"


def variant_rows(sweep: Sweep) -> list[dict[str, Any]]:
    """One row per variant of two or more runs with recorded seeds (the module docstring)."""
    keys = [k for k in sweep.varying if k not in OVERRIDES]
    groups: dict[str, list[Path]] = {}
    for run in sweep.runs:
        groups.setdefault(sweep.name(run, keys) if keys else "all runs", []).append(run)
    rows = []
    for name, runs in groups.items():
        seeds = [s for r in runs if (s := recorded(sweep.summaries[r].get("config"))) is not None]
        if len(seeds) < 2:
            continue
        moved = varied(seeds)
        by_seed = moved == list(KEYS) and all(
            set(k for k in OVERRIDES if sweep.overrides[r].get(k) not in (None, "")) <= {"seed"} for r in runs)
        dropout = [FOLLOWS if s.dropout is None else s.dropout for s in seeds]
        rows.append({"variant": name, "runs": len(seeds) if len(seeds) == len(runs) else f"{len(seeds)}/{len(runs)}",
                     "init": _values([s.init for s in seeds]), "data": _values([s.data for s in seeds]),
                     "dropout": _values(dropout),
                     "varied": varied_label(moved, seeds, by_seed),
                     "spread": spread(moved, by_seed)})
    return rows


@section(12)
def seeds(sweep: Sweep) -> str:
    """The seeds section (module docstring); empty when no variant has two runs with recorded seeds."""
    rows = variant_rows(sweep)
    if not rows:
        return ""
    kinds = {row["varied"] for row in rows}
    if len(kinds) > 1:
        said = "; ".join(f"{row['variant']}: {row['varied']}" for row in rows)
        sweep.notes.append(f"the variants' spreads vary different seeds ({said}): their sds measure different noise "
                           f"(compare_seeds.md)")
    return ("\nSeeds per variant (which varied among its runs: init luck, data-order luck or both)\n\n"
            + write_table(rows, COLS, sweep.dir / "compare_seeds"))
