"""Tables as lmlab writes them: markdown to read and CSV for tools, side by side (compare, eval, a task's section)."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lmlab.record.rundir import atomic_write


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4g}"
    return "" if v is None else str(v)


def write_table(rows: Sequence[dict[str, Any]], cols: Sequence[str], stem: Path, md_cols: Sequence[str] | None = None,
                md_cell: Callable[[dict[str, Any], str], str] | None = None) -> str:
    """Write stem.md and stem.csv; return the markdown. The markdown shows `md_cols` (default: `cols`), each cell
    `md_cell(row, col)` (default: the value)."""
    md_cols, md_cell = md_cols or cols, md_cell or (lambda r, c: fmt(r.get(c)))
    lines = ["| " + " | ".join(md_cols) + " |", "|" + "---|" * len(md_cols)]
    lines += ["| " + " | ".join(md_cell(r, c) for c in md_cols) + " |" for r in rows]
    md = "\n".join(lines) + "\n"
    atomic_write(stem.with_suffix(".md"), md)
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(cols), extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(stem.with_suffix(".csv"), buf.getvalue())
    return md


_fmt = fmt  # the name compare.py used
