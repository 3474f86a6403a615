"""The sections of `eval.py compare=`: what a sweep's report holds after its main table, each registered by the study
or figure it belongs to (`@section(order)`), in order. A section reads the sweep (`Sweep`: its runs, their summaries,
overrides, rows and metrics) and returns its markdown (empty when the sweep has nothing for it), writing its own
tables and plots into the sweep directory; a note it adds (`sweep.notes`) goes above every table. A new figure or
study is its section, where it lives: the comparison function does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from lmlab.record.plots import read_metrics
from lmlab.record.rundir import METRICS
from lmlab.run.seeds import OVERRIDES as SEEDS  # seed, seeds.init, seeds.data, seeds.dropout: none tells variants apart

SEED, LR = "seed", "optim.lr"
SWEEP = "sweep"  # compare= over several sweeps: the sweep a run came from, one of its keys


@dataclass
class Sweep:
    dir: Path
    runs: list[Path]  # in the report's order
    summaries: dict[Path, dict[str, Any]]
    overrides: dict[Path, dict[str, str]]
    varying: list[str]  # the override keys that differ between runs (the architecture first, then lr, then seed)
    rows: list[dict[str, Any]]  # the main table's, one per run
    values: list[float]  # each run's objective (`ranked_by`; +inf unfinished: lmlab.record.summary.objective)
    target: float | None  # the val loss the *_to_target columns count to
    baseline: str | None  # `baseline=key=value` of the significance tests
    by_lr: list[str]  # ["best_lr"] when optim.lr varies
    active_col: list[str]  # ["n_active_params"] when some run's active weights differ from its total (MoE)
    notes: list[str] = field(default_factory=list)  # printed above the tables and in compare.md
    ranked_by: str = "best_val_loss"  # what `values` and the significance tests read (best_val_bpb across tokenizers)

    @property
    def variant_keys(self) -> list[str]:
        """The keys that tell variants apart: every varying key but the seeds (`seed` and the split's `seeds.*`)."""
        return [k for k in self.varying if k not in SEEDS]

    def name(self, run: Path, by: Sequence[str]) -> str:
        """A run's label in the plots: its values of the keys `by`."""
        return (",".join(f"{k}={self.overrides[run].get(k, '')}" for k in by)
                or ("all seeds" if any(k in SEEDS for k in self.varying) else run.name))

    @cached_property
    def logged(self) -> dict[Path, dict[str, list[tuple[int, float]]]]:
        """Each run's metrics.csv (those that have one), read once for every section."""
        return {r: read_metrics(r / METRICS) for r in self.runs if (r / METRICS).exists()}


Section = Callable[[Sweep], str]
SECTIONS: list[tuple[int, str, Section]] = []


def section(order: int) -> Callable[[Section], Section]:
    """Register a section of the report at `order` (lower first)."""
    def register(fn: Section) -> Section:
        SECTIONS.append((order, f"{fn.__module__}.{fn.__qualname__}", fn))
        SECTIONS.sort(key=lambda s: (s[0], s[1]))
        return fn

    return register
