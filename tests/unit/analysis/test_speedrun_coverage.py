"""docs/studies/speedrun_coverage.md against the ladder: every row it names exists, every ladder row after the first
is named by the record its YAML's comment gives, and the counts its opening states are the table's."""

from __future__ import annotations

import re

from lmlab import CONF_DIR
from tests.runs import ROOT

TABLE = (ROOT / "docs" / "studies" / "speedrun_coverage.md").read_text()
ROWS = {p.stem: p.read_text() for p in (CONF_DIR / "speedrun_step").glob("*.yaml")}


def _records() -> dict[int, tuple[str, str]]:
    """Record number -> (kind, the lmlab cell)."""
    out = {}
    for m in re.finditer(r"^\| (\d+) \| .*? \| (ML|systems) \| (.*) \|$", TABLE, re.M):
        out[int(m.group(1))] = (m.group(2), m.group(3))
    return out


def test_the_table_names_existing_rows_and_every_row_its_record() -> None:
    records = _records()
    assert sorted(records) == list(range(1, 90))  # the 89 records, one row each
    named = {row for _, cell in records.values() for row in re.findall(r"speedrun_step=(\d\d_\w+)", cell)}
    assert named <= ROWS.keys(), sorted(named - ROWS.keys())
    for row, text in ROWS.items():
        if row == "00_gpt2":
            continue
        # the row's own record, from its comment
        number = int(re.search(r"^# Row \d+, (?:the speedrun's )?record (\d+)", text, re.M).group(1))
        kind, cell = records[number]
        assert kind == "ML" and f"speedrun_step={row}" in cell, (row, number)


def test_the_opening_counts_are_the_tables() -> None:
    records = _records()
    ml = {n: cell for n, (kind, cell) in records.items() if kind == "ML"}
    rows = [n for n, cell in ml.items() if "speedrun_step=" in cell]
    partly = [n for n, cell in ml.items() if cell.startswith("partly")]
    missing = [n for n, cell in ml.items() if cell.startswith("not expressed")]
    opening = re.search(r"Of the (\d+) ML records, lmlab expresses (\d+) fully and (\d+) partly and (\d+)\s+not at "
                        r"all .*?\*\*(\d+) of the (\d+) \((\d+)%\) are rows", TABLE, re.S)
    assert opening, "the opening's counts"
    n_ml, full, part, none, n_rows, n_ml2, pct = map(int, opening.groups())
    assert (n_ml, n_ml2) == (len(ml), len(ml))
    assert (full, part, none) == (len(ml) - len(partly) - len(missing), len(partly), len(missing))
    assert n_rows == len(rows) and pct == round(100 * len(rows) / len(ml))
    assert len(rows) >= 0.9 * len(ml)  # the bar: 90% of the records that are not systems-only are rows
