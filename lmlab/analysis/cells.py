"""A long evaluation's cells, kept as they finish, and the lines that say how far it got.

eval.py's length sweep is a grid of cells (a length × a RoPE scaling), some of them minutes each on a CPU. Each
finished cell is appended to `cells.jsonl` in the output directory with what it was computed from (the run's
checkpoint and the evaluation's settings), so an interrupted sweep keeps what it finished and the same command
continues with the rest; the file is removed once the whole result is written. `Progress` prints a line to stderr
every ~5% of the work and at each finished cell, with an estimate of the time left.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any, TextIO

CELLS = "cells.jsonl"


class Interrupted(Exception):
    """Ctrl-C or SIGTERM in the middle of an evaluation: `line` says what was kept and how to finish."""

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line


class Cells:
    """The finished cells of one evaluation in `out/cells.jsonl`: a cell is reused only when it was computed from the
    same `identity` (the checkpoint and the settings); lines of another identity are dropped at the next write."""

    def __init__(self, out: Path, identity: dict[str, Any]) -> None:
        self.path, self.identity = out / CELLS, json.loads(json.dumps(identity))
        self.done: dict[str, dict[str, Any]] = {}
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    cell = json.loads(line)
                except json.JSONDecodeError:  # the last line of a process killed mid-write
                    continue
                ours = isinstance(cell, dict) and cell.get("identity") == self.identity
                if ours and isinstance(cell.get("key"), str):
                    self.done[cell["key"]] = cell
        self.kept = len(self.done)  # from an earlier, interrupted evaluation
        out.mkdir(parents=True, exist_ok=True)
        with open(self.path, "w") as f:  # only this identity's cells stay
            f.writelines(json.dumps(c) + "\n" for c in self.done.values())

    @staticmethod
    def key(cell: Hashable) -> str:
        return json.dumps(cell)

    def get(self, cell: Hashable) -> dict[str, Any] | None:
        return self.done.get(self.key(cell))

    def add(self, cell: Hashable, **value: Any) -> None:
        record = {"key": self.key(cell), "identity": self.identity, **value}
        self.done[record["key"]] = record
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def finish(self) -> None:
        """The whole result is written: nothing left to continue."""
        self.path.unlink(missing_ok=True)


class Progress:
    """Lines on stderr as `work` units get done: one every ~5% of the `total` and one per finished cell, with the
    time left estimated from the rate so far (the cells already kept count as done, not in the rate)."""

    def __init__(self, total: float, what: str, stream: TextIO | None = None) -> None:
        self.total, self.what, self.stream = max(total, 1e-9), what, stream or sys.stderr
        self.done = self._rate_from = 0.0
        self._start, self._shown = time.monotonic(), -1.0

    def skip(self, units: float) -> None:
        """Work done before this process (kept cells)."""
        self.done += units
        self._rate_from = self.done

    def tick(self, units: float) -> None:
        self.done += units
        if self.done / self.total - self._shown >= 0.05:
            self._line("")

    def cell(self, label: str) -> None:
        self._line(f": {label}")

    def _line(self, tail: str) -> None:
        self._shown = self.done / self.total
        spent, run = time.monotonic() - self._start, self.done - self._rate_from
        left = spent / run * (self.total - self.done) if run > 0 else None
        eta = "" if left is None else f", about {_duration(left)} left"
        print(f"{self.what}: {100 * self._shown:.0f}%{eta}{tail}", file=self.stream, flush=True)


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"
