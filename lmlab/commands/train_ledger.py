"""train.py's side of the ledger (`ledger=<file>`, lmlab.record.ledger): the row of each way a run ends, appended and
printed last as `LEDGER {...}`, and the ledger file, run directory and overrides as typed, for a refusal that comes
before Hydra composes the config."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LEDGER_ROWS: list[str] = []  # the ledger rows this process wrote (ledger=<file>), as lines
# What lmlab.commands.refusals.usage_errors turns into one line and exit code 2: a run that raised one of these before a
# summary.json was written was refused, not failed
REFUSALS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError)


def ledger_row(ledger_file: Path | None, run_dir: str | None, overrides: list[str], status: str | None, *,
                summary: dict[str, Any] | None = None, error: BaseException | str | None = None,
                started: float | None = None, horizon: Any = None) -> None:
    """Append the run's row to `ledger_file` and print it as stdout's last line, `LEDGER {...}` (rank 0 only).
    After an exception (`error`, `status` None) the status is that of the summary.json this attempt wrote, if it got
    that far (failed, interrupted: its figures too), else `refused` for a usage error, `interrupted` for a signal,
    `failed` for anything else."""
    from lmlab.env import is_rank_zero
    from lmlab.record import ledger

    if ledger_file is None or not is_rank_zero():
        return
    if status is None:
        summary = written_since(run_dir, started)
        status = (summary or {}).get("status") or (
            "refused" if isinstance(error, REFUSALS) else
            "interrupted" if isinstance(error, KeyboardInterrupt | SystemExit) else "failed")
    if isinstance(error, BaseException):
        error = f"{type(error).__name__}: {error}" if status == "failed" else str(error) or type(error).__name__
    row = ledger.row(status, run_dir=os.path.abspath(run_dir) if run_dir else None, overrides=overrides,
                     code=ledger.code_version(), summary=summary, error=error,
                     peak_memory_gib=(summary or {}).get("peak_memory_gib") or (  # (a summary that records it)
                         ledger.peak_memory_gib(run_dir) if summary and run_dir else None),
                     horizon=horizon.record() if horizon is not None else None)
    line = ledger.append(ledger_file, row)
    LEDGER_ROWS.append(line)
    print(ledger.PREFIX + line, flush=True)


def written_since(run_dir: str | None, started: float | None) -> dict[str, Any] | None:
    """The run directory's summary.json if this attempt wrote it (not an earlier attempt's), else None."""
    import json

    if run_dir is None or started is None:
        return None
    path = Path(run_dir) / "summary.json"
    try:
        return json.loads(path.read_text()) if path.stat().st_mtime >= started else None
    except (OSError, ValueError):
        return None


def typed_ledger(argv: Sequence[str]) -> Path | None:
    """The ledger file the command line names (`ledger=<file>`, the last one), before Hydra reads it; None for none."""
    value = None
    for arg in argv:
        key, eq, v = arg.partition("=")
        if eq and key.lstrip("+") == "ledger":
            value = v.strip("'\"")
    if not value or value.lower() in ("null", "none", "true", "false") or Path(value).is_dir():
        return None  # (ledger.target refuses all but null, naming the key)
    return Path(value)


def typed_run_dir(argv: Sequence[str]) -> str | None:
    """The run directory the command line names (`hydra.run.dir=`), None for Hydra's own choice."""
    return next((a.partition("=")[2].strip("'\"") for a in reversed(argv) if a.startswith("hydra.run.dir=")), None)


def typed_overrides(argv: Sequence[str]) -> list[str]:
    return [a for a in argv if "=" in a and not a.startswith("-")]
