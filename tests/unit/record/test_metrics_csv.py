"""metrics.csv: one row per step, the same file a full rewrite would give after every save, appended in place
(a long run must not rewrite its whole history at every logging step), kept across resume."""

from __future__ import annotations

import csv
import io
import logging
from pathlib import Path

import pytest

from lmlab.record.metrics_csv import MetricsCSV


def full_rewrite(rows: list[dict]) -> str:
    keys = sorted({k for row in rows for k in row} - {"step"})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=["step", *keys])
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()


def test_every_save_leaves_the_full_file_and_appends_in_place(tmp_path: Path) -> None:
    log = MetricsCSV(tmp_path)
    expected: dict[int, dict] = {}
    # (step, values, save after?): same-step merges before and after a save, new columns, plain appends.
    events = [(0, {"a": 1.0}, True), (0, {"b": 2.0}, True), (1, {"a": 3.0}, True), (2, {"a": 4.0}, False),
              (2, {"b": 5.0}, True), (3, {"a": 6.0}, True), (3, {"b": 7.0}, True), (4, {"c": 8.0}, True),
              (5, {"a": 9.0}, True), (6, {"a": 10.0}, True), (6, {"c": 11.0}, True), (7, {"b": 12.0}, True)]
    inodes = []
    for step, values, save in events:
        log.log_metrics(values, step=step)
        expected.setdefault(step, {"step": step}).update(values)
        if save:
            log.save()
            rows = [{"step": str(r["step"]), **{k: str(v) for k, v in r.items() if k != "step"}}
                    for r in expected.values()]
            assert log.path.read_text().replace("\r\n", "\n") == full_rewrite(rows).replace("\r\n", "\n"), step
            inodes.append(log.path.stat().st_ino)
    # The header settled after the new column "c" (event 8): every later save appended to the same file.
    assert len(set(inodes[7:])) == 1
    with open(log.path, newline="") as f:
        read = list(csv.DictReader(f))
    assert [int(r["step"]) for r in read] == list(range(8))
    assert read[6] == {"step": "6", "a": "10.0", "b": "", "c": "11.0"}


def test_resume_keeps_the_rows_before_the_resumed_step(tmp_path: Path) -> None:
    first = MetricsCSV(tmp_path)
    for step in range(10):
        first.log_metrics({"loss": 10.0 - step}, step=step)
    first.finalize("success")
    resumed = MetricsCSV(tmp_path, resume_step=6)
    for step in range(6, 8):
        resumed.log_metrics({"loss": 100.0 + step, "lr": 0.5}, step=step)
        resumed.save()
    with open(resumed.path, newline="") as f:
        read = list(csv.DictReader(f))
    assert [int(r["step"]) for r in read] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert [float(r["loss"]) for r in read] == [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 106.0, 107.0]
    assert read[0]["lr"] == "" and read[7]["lr"] == "0.5"


def test_a_resumed_log_joins_the_row_of_a_step_read_back_from_the_file(tmp_path) -> None:
    """Rows read back hold their step as text: the resumed run's figures for the last kept step join that row."""
    first = MetricsCSV(tmp_path)
    for step in range(5):
        first.log_metrics({"train/loss": 5.0 - step}, step=step)
    first.save()
    resumed = MetricsCSV(tmp_path, resume_step=3)
    resumed.log_metrics({"val/loss": 2.5}, step=2)  # a figure of step 2, logged after the resume
    resumed.log_metrics({"train/loss": 2.0}, step=3)
    resumed.save()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["0", "1", "2", "3"]
    assert rows[2]["train/loss"] == "3.0" and rows[2]["val/loss"] == "2.5" and rows[3]["train/loss"] == "2.0"


@pytest.mark.parametrize(("tail", "kept"), [(b"10,0.", 5), (b"1", 5), (b"\0" * 4096, 5),
                                           (b"5,0.2\r\n" + b"\0" * 100, 6)])  # a whole row before the NULs: kept
def test_a_torn_tail_is_dropped_naming_the_file_and_the_file_is_repaired(tmp_path: Path, tail: bytes, kept: int,
                                                                        caplog) -> None:
    """A kill mid-append left digits with no line end (kept as a junk row), a crash left NUL bytes (the resume
    failed on csv's "line contains NUL" without naming the file): the tail is dropped with a warning naming
    metrics.csv, and the resumed run's first save rewrites the file whole."""
    first = MetricsCSV(tmp_path)
    for step in range(5):
        first.log_metrics({"loss": 5.0 - step}, step=step)
    first.save()
    with open(first.path, "ab") as f:
        f.write(tail)
    with caplog.at_level(logging.WARNING, logger="lmlab.record.metrics_csv"):
        resumed = MetricsCSV(tmp_path, resume_step=5)
    assert [r["step"] for r in resumed.rows] == list(range(kept))
    assert f"{first.path}: dropped " in caplog.text
    resumed.log_metrics({"loss": 0.5}, step=5)
    resumed.save()
    data = first.path.read_bytes()
    assert b"\0" not in data and data.endswith(b"\n")
    with open(first.path, newline="") as f:
        assert [int(r["step"]) for r in csv.DictReader(f)] == [0, 1, 2, 3, 4, 5]


def test_nul_bytes_before_the_last_row_are_refused_naming_the_file_and_line(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_bytes(b"step,loss\r\n0,1.0\r\n1,\0\0\r\n2,0.5\r\n")
    with pytest.raises(ValueError, match=r"metrics.csv: NUL bytes at line 3, before its last row"):
        MetricsCSV(tmp_path, resume_step=2)
