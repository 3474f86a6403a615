"""The results ledger of fixed-budget loops: `python train.py budget.wall=300 ledger=runs.jsonl` appends one JSON line
per run to runs.jsonl and prints the same object as its last stdout line, `LEDGER {...}` (`grep '^LEDGER '` finds it
in a sweep's output too); `lmlab ledger runs.jsonl` reads it back (lmlab.analysis.ledger).

Every end writes its row: completed, diverged, collapsed, interrupted, failed, and `refused` (a bad value or key,
refused before training, exit code 2 as always) with its error. A row is written by one `os.write` of the whole line
on a descriptor opened with O_APPEND, under an exclusive `flock` of the file: rows from many processes (a sweep's jobs,
several loops sharing one ledger) never interleave, and a write cut short (a full disk) is truncated away, so the file
never holds part of a row. The flock is advisory: an editor saving the file meanwhile is not held off.
"""

from __future__ import annotations

import csv
import fcntl
import hashlib
import json
import math
import os
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lmlab import names

PREFIX = "LEDGER "  # the printed line: PREFIX + the row's JSON


def target(cfg: Mapping[str, Any]) -> Path | None:
    """The ledger file `ledger=` names (None: no ledger); refuses a value that is not a file path."""
    value = cfg.get("ledger")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int) or str(value).strip() == "":
        raise ValueError(f"ledger={value!r} must be the path of a JSONL file (or null: no ledger)")
    path = Path(str(value))
    if path.is_dir():
        raise ValueError(f"ledger={value}: is a directory; name a file in it, e.g. ledger={path / 'runs.jsonl'}")
    return path


def row(status: str, *, run_dir: str | Path | None, overrides: list[str], code: tuple[str | None, str | None],
        summary: Mapping[str, Any] | None = None, error: str | None = None, peak_memory_gib: float | None = None,
        horizon: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The ledger's row for a run that ended with `status`: its figures from `summary` (summary.json's; None for a
    refusal), `code` = (commit, dirty) from `code_version`, `horizon` = what budget.wall's fit measured
    (lmlab.run.budget.WallHorizon.record: the steps it fitted, the seconds trained)."""
    s = summary or {}
    budget = dict(s["budget"]) if isinstance(s.get("budget"), Mapping) else None
    if horizon and budget is not None:
        budget.update(steps=horizon.get("horizon"), trained_s=horizon.get("trained_s"))
    config = s.get("config") or {}
    out = {"status": status, "val_bpb": s.get("final_val_bpb"), "val_loss": s.get("final_val_loss"),
           "params": s.get("n_params"), "tokens": s.get("tokens"), "flops": (s.get("budget_spent") or {}).get("flops"),
           "mfu": s.get("mfu"), "peak_memory_gib": peak_memory_gib, "wall_s": s.get("wall_time_s"),
           "steps": s.get("steps"), "seed": config.get("seed"), "seeds": config.get("seeds"), "commit": code[0],
           "dirty": code[1], "overrides": list(overrides), "run_dir": None if run_dir is None else str(run_dir),
           "budget": budget, "error": error if error is not None else s.get("error"),
           "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    return _finite(out)


def _finite(value: Any) -> Any:
    """`value` with every non-finite float as None (strict JSON, as summary.json)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def dumps(r: Mapping[str, Any]) -> str:
    """One row as one line of strict JSON (no newline inside: json.dumps escapes them in strings)."""
    return json.dumps(_finite(r), allow_nan=False, ensure_ascii=False, default=str)


def append(path: str | Path, r: Mapping[str, Any]) -> str:
    """Append row `r` to the ledger at `path` (made, with its directory, if missing) as one whole line; returns the
    line (without its newline). Safe under concurrent appends from any number of processes (module docstring)."""
    text = dumps(r)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)  # (read: its last byte)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
        size = os.fstat(fd).st_size
        # a hand edit may have left the last line without its newline: the row starts a line of its own
        data = (("\n" if size and os.pread(fd, 1, size - 1) != b"\n" else "") + text + "\n").encode()
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(f"{path}: wrote {written} of {len(data)} bytes (is the disk full?)")
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, size)  # never part of a row
            raise
    finally:
        os.close(fd)
    return text


def read(path: str | Path) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
    """The ledger's rows, and its bad lines as (line number, why): a line that is not JSON, not an object or without
    a status (a hand edit) is reported and skipped; blank lines are skipped silently."""
    rows, bad = [], []
    with open(path, encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as err:
                bad.append((n, f"not JSON ({err.msg})"))
                continue
            if not isinstance(r, dict):
                bad.append((n, f"not a JSON object (a {type(r).__name__})"))
            elif not isinstance(r.get("status"), str):
                bad.append((n, "no status"))
            else:
                rows.append(r)
    return rows, bad


def code_version(root: str | Path | None = None) -> tuple[str | None, str | None]:
    """(commit, dirty) of the lmlab checkout this process runs from: `git rev-parse HEAD` (None outside a checkout,
    e.g. an installed wheel) and, when its tracked files differ from HEAD, the first 12 hex digits of the diff's sha256
    (None when clean): two rows of one commit with different edits are different code. Nothing is written to the
    repository (GIT_OPTIONAL_LOCKS=0: git refreshes no index)."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[2]
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> bytes | None:
        try:
            res = subprocess.run(["git", "-C", str(root), *args], capture_output=True, timeout=20, env=env)
        except (OSError, subprocess.SubprocessError):
            return None
        return res.stdout if res.returncode == 0 else None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top.decode().strip()).resolve() != root.resolve():  # lmlab inside another repository
        return None, None
    head = git("rev-parse", "HEAD")
    if head is None:
        return None, None
    diff = git("diff", "HEAD", "--no-ext-diff", "--binary")
    return head.decode().strip(), hashlib.sha256(diff).hexdigest()[:12] if diff else None


def peak_memory_gib(run_dir: str | Path) -> float | None:
    """The run's peak memory (GiB): the largest perf/max_memory of its metrics.csv (the CUDA allocator's peak on a GPU,
    the process's peak RSS on a CPU; lmlab.run.perf), None when it logged none."""
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        return None
    peak = None
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            try:
                value = float(r.get(names.MAX_MEMORY) or "nan")
            except ValueError:
                continue
            if math.isfinite(value):
                peak = value if peak is None else max(peak, value)
    return peak
