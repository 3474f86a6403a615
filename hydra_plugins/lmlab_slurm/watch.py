"""Waiting for a sweep's SLURM jobs without accounting: a job is done when submitit's result pickle is there, and lost
when SLURM says it ended (or no longer knows it) and no result came.

submitit's own wait asks `sacct` for a job's state. Without slurmdbd `sacct` fails, the state is UNKNOWN and a job
that ended without a result pickle (a plain `scancel`, a kill, out of memory, lmlab's exit after a signal) is
waited on forever; with accounting, one such job raises and ends the submitting command while the rest of the
array runs on unwatched. `squeue -t all` answers on every cluster (the controller keeps ended jobs for `MinJobAge`,
300 s by default), so this asks squeue, once per poll for the whole sweep, and waits for every job.
"""

from __future__ import annotations

import subprocess
import sys
import time
from typing import Any

# squeue's states of a job that will not run again by itself. REQUEUED, PENDING (BeginTime) and RUNNING follow
# `scontrol requeue` (lmlab's answer to SIGUSR1), so a requeued job is waited on.
ENDED = frozenset({"BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
                   "PREEMPTED", "SPECIAL_EXIT", "TIMEOUT", "REVOKED"})
GRACE_S = 15.0  # after SLURM says a job ended, how long its result pickle may take to appear (a shared file system)
POLL_S = 3.0


class Watched:
    """One job of the sweep as the submitter sees it. `outcome`: ("success", JobReturn) or ("error", traceback)
    from the result pickle; None with `lost` set when SLURM ended the job without one. (A plain class: Hydra's plugin
    scan runs this module outside sys.modules, where a dataclass cannot be made.)"""

    def __init__(self, job: Any) -> None:
        self.job = job  # submitit's Job
        self.state, self.reason = "PENDING", ""
        self.outcome: tuple[str, Any] | None = None
        self.lost: str | None = None
        self.ended_at: float | None = None

    @property
    def finished(self) -> bool:
        return self.outcome is not None or self.lost is not None


def squeue(job_ids: list[str]) -> dict[str, tuple[str, str]] | None:
    """{job id: (state, reason)} for every task of these jobs that the controller still knows; None when squeue
    itself fails (the controller does not answer: nothing can be concluded)."""
    base = sorted({j.split("_")[0] for j in job_ids})
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(base), "-o", "%i|%T|%r"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode:  # "Invalid job id specified": every job of the list was purged, which is an answer
        return {} if "Invalid job id" in out.stderr else None
    states = {}
    for line in out.stdout.splitlines():
        job_id, state, reason = (line.split("|") + ["", ""])[:3]
        states[job_id.strip()] = (state.strip(), reason.strip())
    return states


def wait(jobs: list[Any], poll_s: float = POLL_S, grace_s: float = GRACE_S) -> list[Watched]:
    """Wait until every job has a result or is lost; print each job's state as it changes (PENDING, RUNNING, a
    requeue), so that a sweep that waits on the scheduler says why."""
    from submitit.core.utils import pickle_load

    watched = [Watched(job) for job in jobs]
    silent_controller = False
    while not all(w.finished for w in watched):
        states = squeue([w.job.job_id for w in watched if not w.finished])
        if states is None and not silent_controller:
            print("slurm: squeue does not answer; still waiting for the jobs", file=sys.stderr, flush=True)
        silent_controller = states is None
        now = time.time()
        for w in watched:
            if w.finished:
                continue
            if w.job.paths.result_pickle.exists():
                w.outcome = _load(pickle_load, w.job.paths.result_pickle)
                continue
            if states is None:
                continue
            state, reason = states.get(w.job.job_id, ("GONE", "no longer known to the controller"))
            if (state, reason) != (w.state, w.reason):
                w.state, w.reason = state, reason
                why = f" ({reason})" if reason and reason != "None" else ""
                print(f"slurm job {w.job.job_id}: {state}{why}", flush=True)
            if state in ENDED or state == "GONE":
                w.ended_at = w.ended_at or now
                if now - w.ended_at >= grace_s:
                    w.lost = f"SLURM state {state}, no result"
            else:
                w.ended_at = None  # a requeue passes through an ended-looking state; it is running again
        if not all(w.finished for w in watched):
            time.sleep(poll_s)
    return watched


def _load(pickle_load, path) -> tuple[str, Any]:
    for _ in range(5):  # the pickle is renamed into place, but a shared file system may show it before its bytes
        try:
            return pickle_load(path)
        except EOFError:
            time.sleep(1)
    return ("error", f"unreadable result pickle {path}")
