"""metrics.csv in the run directory, whatever other logger is chosen.

Lightning's CSVLogger deletes an existing metrics.csv when it starts, which would lose the first part of a
resumed run's curve. This logger keeps the rows logged before the step it resumes from and appends.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only


class MetricsCSV(Logger):
    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        super().__init__()
        self.path = Path(run_dir) / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        if resume_step is not None and self.path.exists():
            with open(self.path, newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if int(float(r["step"])) < resume_step]

    @property
    def name(self) -> str:
        return "metrics_csv"

    @property
    def version(self) -> str:
        return ""

    @property
    def save_dir(self) -> str:
        return str(self.path.parent)

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass  # the whole config is in .hydra/config.yaml and summary.json

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        values = {k: float(v) for k, v in metrics.items()}
        if self.rows and self.rows[-1]["step"] == step:  # Lightning's metrics and the monitor's: one row per step
            self.rows[-1].update(values)
        else:
            self.rows.append({"step": step, **values})

    @rank_zero_only
    def save(self) -> None:
        keys = sorted({k for row in self.rows for k in row} - {"step"})
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["step", *keys])
            writer.writeheader()
            writer.writerows(self.rows)
        tmp.replace(self.path)  # atomic: a crash mid-write never leaves a truncated file

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()
