"""metrics.csv in the run directory, whatever other logger is chosen.

Lightning's CSVLogger deletes an existing metrics.csv when it starts, which would lose the first part of a
resumed run's curve. This logger keeps every row of the file; when the resumed run logs its first step, the rows
from that step on (logged after the checkpoint by an attempt that was then killed) are replaced. A resume that
fails before it logs anything leaves the file as it was. One row per step: values logged for the step of the
last row (the monitor's figures, then Lightning's) join that row.

Each save appends the rows that are new since the last one (rewriting only the last row when it grew), so a long
run costs O(new rows) per save; the whole file is rewritten, atomically, only when a new column appears.
"""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers.logger import Logger
from lightning.pytorch.utilities import rank_zero_only

from lmlab.record.rundir import atomic_write

log = logging.getLogger(__name__)


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.csv, steps as integers (one row per step), without the tail a killed or crashed write
    left: a last row with no line end (the append was cut) or NUL bytes (a crash before the data reached the disk)
    is dropped with a warning naming the file, and the file is rewritten whole at the resumed run's first save."""
    data = path.read_bytes()
    kept = data.rstrip(b"\0")
    if kept and not kept.endswith(b"\n"):
        kept = kept[: kept.rfind(b"\n") + 1]
    if b"\0" in kept:
        line = kept[: kept.index(b"\0")].count(b"\n") + 1
        raise ValueError(f"{path}: NUL bytes at line {line}, before its last row: a damaged file (restore it, or "
                         f"remove it to continue without the curve so far)")
    if len(kept) != len(data):
        dropped = data[len(kept):]
        what = f"{dropped.count(0)} NUL bytes" if dropped.strip(b"\0") == b"" else f"a torn last row {dropped[:60]!r}"
        log.warning(f"{path}: dropped {what} at its end, which an interrupted write left")
    rows = []
    for n, row in enumerate(csv.DictReader(io.StringIO(kept.decode(errors="replace"), newline="")), start=2):
        try:
            rows.append({**row, "step": int(float(row["step"]))})
        except (TypeError, ValueError, KeyError):
            raise ValueError(f"{path}: line {n} has no step ({row.get('step')!r}): not a metrics.csv of lmlab, or "
                             f"damaged") from None
    return rows


class MetricsCSV(Logger):
    def __init__(self, run_dir: str | Path, resume_step: int | None = None) -> None:
        super().__init__()
        self.path = Path(run_dir) / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        self._resume_step = resume_step  # rows from here on are replaced once this run logs (None: a fresh start)
        if resume_step is not None and self.path.exists():
            self.rows = read_rows(self.path)
        self._keys = {k for row in self.rows for k in row} - {"step"}
        self._header: list[str] | None = None  # the columns of the file on disk; None: rewrite at the next save
        self._on_disk = 0  # rows[:_on_disk] are in the file
        self._last_at = 0  # byte offset of the last row in the file
        self._last_changed = False  # rows[_on_disk - 1] grew after it was written

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
        if self._resume_step is not None:  # the resumed run's first row: drop what a killed attempt logged after
            self.rows = [r for r in self.rows if r["step"] < self._resume_step]
            self._resume_step, self._header = None, None  # the file is rewritten at the next save
        self._keys.update(values)
        if self.rows and self.rows[-1]["step"] == step:  # Lightning's metrics and the monitor's: one row per step
            self.rows[-1].update(values)
            self._last_changed |= self._on_disk == len(self.rows)
        else:
            self.rows.append({"step": step, **values})

    @staticmethod
    def _lines(header: list[str], rows: list[dict[str, Any]]) -> list[bytes]:
        out, buf = [], io.StringIO()
        writer = csv.DictWriter(buf, fieldnames=header)
        for row in rows:
            buf.seek(0)
            buf.truncate()
            writer.writerow(row)
            out.append(buf.getvalue().encode())
        return out

    @rank_zero_only
    def save(self) -> None:
        if self._resume_step is not None:
            return  # nothing logged since the resume: the file stays as it was
        header = ["step", *sorted(self._keys)]
        if header != self._header or not self.path.exists():
            buf = io.StringIO()
            csv.DictWriter(buf, fieldnames=header).writeheader()
            lines = [buf.getvalue().encode(), *self._lines(header, self.rows)]
            atomic_write(self.path, b"".join(lines))  # a crash mid-write never leaves a truncated file
            self._header, end = header, sum(map(len, lines))
        else:
            start = self._on_disk - 1 if self._last_changed else self._on_disk
            if start >= len(self.rows):
                return
            lines = self._lines(header, self.rows[start:])
            with open(self.path, "r+b") as f:
                if self._last_changed:
                    f.seek(self._last_at)  # the last row on disk grew: write it again
                else:
                    f.seek(0, io.SEEK_END)
                f.truncate()
                f.write(b"".join(lines))
                end = f.tell()
        self._on_disk, self._last_changed, self._last_at = len(self.rows), False, end - len(lines[-1])

    @rank_zero_only
    def finalize(self, status: str) -> None:
        self.save()
