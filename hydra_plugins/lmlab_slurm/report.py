"""How each job of a SLURM sweep ended, one line per job, from its run's summary.json (the run's own record, the same
whichever attempt of a requeued job wrote it) and, for a job SLURM ended without a result, from its log."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

OK = ("completed", "diverged", "collapsed")  # finished runs: an ablation's result, not a failed job
                                             # (lmlab.record.summary)


def _loss(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, (int, float)) and math.isfinite(value) else "none"


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:300] if lines else ""


def line(job_id: str, overrides: str, run_dir: Path, outcome: tuple[str, Any] | None, lost: str | None,
         stderr: Path) -> tuple[str, bool]:
    """The report line of one job and whether the job failed (the submitting command then exits non-zero). A job
    fails when its run did not finish (interrupted, failed, no summary) or SLURM ended it without a result."""
    from lmlab.record.rundir import RunDir

    head = f"slurm job {job_id}" + (f" [{overrides}]" if overrides else "") + ":"
    try:
        summary = RunDir(run_dir).read_summary()
    except ValueError as err:
        summary, unreadable = None, str(err)
    else:
        unreadable = None
    if outcome is not None and outcome[0] == "error":  # an exception outside lmlab's task (Hydra, submitit)
        return f"{head} failed: {outcome[1].strip().splitlines()[-1]} (log: {stderr})", True
    if summary is None:
        why = unreadable or f"no summary.json in {run_dir}"
        last = _last_line(stderr)
        ended = f"{lost}; " if lost else ""
        return f"{head} failed: {ended}{why}" + (f"; its log ends: {last}" if last else f" (log: {stderr})"), True
    status = summary.get("status")
    text = (f"{head} {status}: step {summary.get('steps')}, val loss {_loss(summary.get('final_val_loss'))}"
            f" -> {run_dir}")
    if status == "failed" and summary.get("error"):
        text += f"; error: {summary['error']}"
    if lost:
        text += f"; {lost}"
        if status == "interrupted":
            text += ": its checkpoint is kept; run the same command again to continue it"
    return text, status not in OK or lost is not None
