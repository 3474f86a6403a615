"""A long evaluation's kept cells (lmlab.analysis.cells): reused only from the same identity, a line cut by a kill
skipped; the progress lines every ~5% and per cell, with the time left from the rate of this process's work."""

from __future__ import annotations

import io
import json
from pathlib import Path

from lmlab.analysis.cells import Cells, Progress


def test_cells_are_reused_only_from_the_same_checkpoint_and_settings(tmp_path: Path) -> None:
    same = {"checkpoint": [10, 5], "max_windows": 16}
    cells = Cells(tmp_path, same)
    cells.add((32, "none"), row={"loss": 1.5}, curve=[1.0, 2.0])
    cells.add((64, "yarn"), row={"loss": 2.5}, curve=[3.0])
    with open(tmp_path / "cells.jsonl", "a") as f:
        f.write('{"key": "[128, \\"none\\"]", "identity": {"checkpo')  # killed mid-write
    again = Cells(tmp_path, same)
    assert again.kept == 2 and again.get((32, "none"))["row"] == {"loss": 1.5} and again.get((128, "none")) is None
    other = Cells(tmp_path, {**same, "checkpoint": [10, 6]})  # the run trained on since: nothing reused
    assert other.kept == 0 and other.get((32, "none")) is None
    assert (tmp_path / "cells.jsonl").read_text() == ""  # and the stale cells are gone
    other.add((32, "none"), row={"loss": 1.0}, curve=[])
    assert [json.loads(line)["row"] for line in (tmp_path / "cells.jsonl").read_text().splitlines()] == [{"loss": 1.0}]
    other.finish()
    assert not (tmp_path / "cells.jsonl").exists()


def test_progress_prints_every_five_percent_and_each_cell(monkeypatch) -> None:
    clock = iter(range(100, 1000))
    monkeypatch.setattr("lmlab.analysis.cells.time.monotonic", lambda: float(next(clock)))
    out = io.StringIO()
    p = Progress(100, "eval run", out)  # started at t = 100
    p.skip(50)  # kept cells: done, not part of the rate
    for _ in range(10):
        p.tick(1)  # 1 unit per tick: 1%; lines at +5% since the last line
    p.cell("length 64 rope_scaling=yarn loss 2.5000")
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("eval run: 51%")  # the first tick, then one per 5%: 56%, 60% (the cell's line)
    assert [line.split(":")[1].split("%")[0].strip() for line in lines] == ["51", "56", "60"]
    # the clock reads 101, 102, 103 at the lines: 10 units in 3 s, 40 left -> 12 s (the 50 kept are not in the rate)
    assert lines[-1] == "eval run: 60%, about 12s left: length 64 rope_scaling=yarn loss 2.5000"
