"""metrics.csv: one row per step, the same file a full rewrite would give after every save, appended in place
(a long run must not rewrite its whole history at every logging step), kept across resume."""

from __future__ import annotations

import csv
import io
from pathlib import Path

from lmlab.metrics_csv import MetricsCSV


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
