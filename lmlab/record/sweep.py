"""A sweep's own record: `sweep.json` in the sweep directory, and what each of its jobs is doing now.

`sweep.json` (the manifest) is written by the submitting process before the first job starts (lmlab's launchers,
hydra_plugins/lmlab_slurm/recorded.py) and rewritten, always atomically, as it learns more: the command as typed,
where it was typed, the composed base config (every job's config before its own overrides) and its hash, and one
entry per job: its overrides, run directory, seed, steps, the scheduler's job id, the state the submitter last saw.
One writer at a time (a flock on `.sweep.lock`); any process may read it at any time.

What a job is doing *now* (`job_states`) is read from where the truth lives, not from the manifest alone: the run
directory (summary.json, metrics.csv, the run lock a live training process holds), the scheduler (squeue) for a job
with a SLURM id, and whether the submitter that would still start a job is alive. So `lmlab sweep status` is right
from another shell while the sweep runs and after its submitter died.

States: pending (queued, or waiting for a live submitter), running, completed, diverged, collapsed (an ablation's
result), failed, interrupted (stopped, checkpoint kept), lost (ended without a result: killed, cancelled, node lost),
not started (no one will start it: its submitter is gone).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import io
import json
import math
import os
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from lmlab import names
from lmlab.record.rundir import RunDir, atomic_write, dumps

MANIFEST = "sweep.json"
LOCK = ".sweep.lock"
FORMAT = 1

FINISHED = ("completed", "diverged", "collapsed")  # a result: resume leaves these alone
ACTIVE = ("pending", "running")  # someone will still run these: resume leaves them alone too
TO_RESUME = ("failed", "interrupted", "lost", "not started")
STATES = (*ACTIVE, *FINISHED, *TO_RESUME)

# `lmlab sweep resume` in this process (lmlab/commands/sweep.py): {"skip": run dirs the launcher leaves alone,
# "allowed": the keys whose drift from the manifest's base config the resume command means}; None otherwise
RESUME: dict[str, Any] | None = None

# squeue's states of a job that is still the scheduler's to run (a requeued job passes through REQUEUED)
_QUEUED = {"PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "RESIZING", "SUSPENDED"}
_RUNNING = {"RUNNING", "COMPLETING", "STAGE_OUT", "SIGNALING"}


def path_of(sweep_dir: str | Path) -> Path:
    return Path(sweep_dir) / MANIFEST


def read(sweep_dir: str | Path) -> dict[str, Any] | None:
    """The manifest of `sweep_dir`, or None when it has none (a sweep of an lmlab before manifests, or not a sweep)."""
    path = path_of(sweep_dir)
    if not path.is_file():
        return None
    size = path.stat().st_size
    if size > MANIFEST_LIMIT:
        raise ValueError(f"{path}: {size:,} bytes, over the {MANIFEST_LIMIT:,} of a sweep manifest: not one lmlab "
                         f"wrote")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}): not a sweep manifest of lmlab, or damaged") from None
    except RecursionError:
        raise ValueError(f"{path} nests too deep: not a sweep manifest of lmlab") from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("jobs"), list):
        raise ValueError(f"{path} has no list of jobs: not a sweep manifest of lmlab")
    for i, job in enumerate(manifest["jobs"]):
        where = f"{path}: jobs[{i}]"
        if not isinstance(job, dict) or not isinstance(job.get("dir"), str):
            raise ValueError(f"{where} is not a job (an object with its `dir`): not a sweep manifest of lmlab")
        sub = Path(job["dir"])
        if sub.is_absolute() or ".." in sub.parts or not job["dir"]:
            raise ValueError(f"{where}: dir={job['dir']!r} is not a directory inside the sweep")
        if not isinstance(job.get("overrides", []), list):
            raise ValueError(f"{where}: overrides is a {type(job['overrides']).__name__}, not a list")
    return manifest


MANIFEST_LIMIT = 64 << 20  # bytes: a manifest of 100,000 jobs is some 50 MB


@contextlib.contextmanager
def updating(sweep_dir: str | Path) -> Iterator[dict[str, Any]]:
    """The manifest to change in place (a new one when there is none), written back atomically at the block's end;
    writers take turns (flock)."""
    sweep_dir = Path(sweep_dir)
    sweep_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(sweep_dir / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        manifest = read(sweep_dir) or {"format": FORMAT, "jobs": []}
        yield manifest
        atomic_write(path_of(sweep_dir), dumps(manifest))
    finally:
        os.close(fd)


def config_hash(config: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16]


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """{dotted key: leaf value} of a nested config (lists are leaves)."""
    if isinstance(config, Mapping) and config:
        out: dict[str, Any] = {}
        for key, value in config.items():
            out.update(flatten(value, f"{prefix}{key}."))
        return out
    return {prefix[:-1]: config}


def drift(recorded: Mapping[str, Any], now: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """The keys whose values differ between two base configs: {key: (recorded, now)} (a missing key is None)."""
    was, new = flatten(recorded), flatten(now)
    return {k: (was.get(k), new.get(k)) for k in sorted(set(was) | set(new)) if was.get(k) != new.get(k)}


def record_launch(sweep_dir: str | Path, *, command: Sequence[str], cwd: str, base: Mapping[str, Any],
                  launcher: str, jobs: Sequence[Mapping[str, Any]], swept: Sequence[str] = ()) -> dict[str, Any]:
    """Before a batch of jobs starts: the sweep (on its first batch) and these jobs, in the manifest. A job already
    there (the same run directory: a resumed or re-run sweep) keeps its entry, with what changed updated. `swept`:
    the keys the sweep varies (its sweep overrides, a search's parameters)."""
    with updating(sweep_dir) as manifest:
        if "command" not in manifest:
            manifest.update({"format": FORMAT, "command": list(command), "cwd": cwd,
                             "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "base_config": dict(base),
                             "base_hash": config_hash(base)})
        manifest["swept"] = sorted(set(manifest.get("swept") or []) | set(swept))
        manifest["submitter"] = {"pid": os.getpid(), "host": socket.gethostname(), "launcher": launcher,
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S")}
        by_dir = {job["dir"]: job for job in manifest["jobs"]}
        for job in jobs:
            entry = by_dir.get(job["dir"])
            if entry is None:
                entry = {"num": len(manifest["jobs"]), "scheduler_id": None, "state": "pending", "submissions": 0}
                manifest["jobs"].append(entry)
                by_dir[job["dir"]] = entry
            entry.update(job)
        manifest["jobs"] = manifest.pop("jobs")  # last in the file: the sweep's own keys first
        return manifest


def record_jobs(sweep_dir: str | Path, changes: Mapping[str, Mapping[str, Any]]) -> None:
    """{run dir (relative to the sweep): fields} into the jobs' entries (the submitter's view: ids, states)."""
    with updating(sweep_dir) as manifest:
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        for job in manifest["jobs"]:
            if job["dir"] in changes:
                job.update(changes[job["dir"]], updated=now)


def swept_keys(command: Sequence[str], search_params: Sequence[str] = ()) -> list[str]:
    """The keys a sweep command varies: its sweep overrides (`a=1,2`, `choice(...)`, `range(...)`) and the parameters
    its search draws (hydra.sweeper.params)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, keys = OverridesParser.create(), set(search_params)
    for arg in command:
        if arg.startswith("-") or "=" not in arg:
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001  (Hydra itself reports a malformed override)
            continue
        if override.is_sweep_override():
            keys.add(override.key_or_group)
    return sorted(keys)


def swept_tags(hydra: Any, overrides: Sequence[str]) -> list[str]:
    """A sweep job's values of the keys its sweep varies, as `key=value` tags (W&B groups runs by them); [] outside
    a recorded sweep."""
    from lmlab.cli import override_key

    if hydra is None or hydra.mode.name != "MULTIRUN":
        return []
    try:
        swept = set((read(str(hydra.sweep.dir)) or {}).get("swept") or [])
    except ValueError:
        return []
    return [o[:64] for o in overrides if override_key(o) in swept]  # (W&B's limit on a tag)


def job_event(sweep_dir: str | Path, run_dir: str | Path, state: str, **fields: Any) -> None:
    """A job's own word on its state (train.py in a sweep: `running` at its start, its status at its end), into its
    entry; nothing when the sweep has no manifest (Hydra's own launchers) or it cannot be written (a reader's copy)."""
    if not path_of(sweep_dir).is_file():
        return
    with contextlib.suppress(OSError, ValueError):
        record_jobs(sweep_dir, {os.path.relpath(run_dir, sweep_dir): {"state": state, **fields}})


# --- what the jobs are doing now ------------------------------------------------------------------------------------

def squeue(job_ids: Sequence[str]) -> dict[str, str] | None:
    """{job id: squeue state} for the jobs the controller still knows (`-t all`: ended ones too, for MinJobAge);
    None when squeue cannot answer (no SLURM here, or the controller is down: nothing can be concluded)."""
    ids = sorted({str(j) for j in job_ids if j})
    if not ids:
        return {}
    try:
        out = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(sorted({j.split("_")[0]
                                                                                      for j in ids})),
                              "-o", "%i|%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode:  # every job of the list purged ("Invalid job id specified") is an answer
        return {} if "Invalid job id" in out.stderr else None
    return dict(line.split("|", 1) for line in out.stdout.split() if "|" in line)


def _alive(submitter: Mapping[str, Any] | None) -> bool:
    """Whether the process that submitted the sweep is still running (only knowable on its own host)."""
    if not submitter or submitter.get("host") != socket.gethostname():
        return False
    pid = int(submitter.get("pid") or 0)
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError, ValueError, OverflowError):
        return False
    try:  # a zombie (killed, not yet reaped by its parent) is not running
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _progress(run: RunDir) -> tuple[int | None, float | None]:
    """The last step metrics.csv logged and its last val loss (None, None without one). Read here, not through
    lmlab.record.metrics_csv (a Lightning logger: seconds of imports for a status line); a torn last row is skipped."""
    import csv

    try:
        text = run.metrics.read_bytes().rstrip(b"\0").decode(errors="replace") if run.metrics.is_file() else ""
    except OSError:
        return None, None
    step, val = None, None
    for row in csv.DictReader(io.StringIO(text[: text.rfind("\n") + 1])):
        try:
            step = int(float(row["step"]))
            if row.get(names.VAL_LOSS):
                val = float(row[names.VAL_LOSS])
        except (KeyError, TypeError, ValueError):
            continue
    return step, val


_ASK = object()


def job_states(sweep_dir: str | Path, manifest: Mapping[str, Any] | None = None,
               scheduler: Any = _ASK) -> list[dict[str, Any]]:
    """One row per job of the manifest: num, dir, overrides, state, step, max_steps, val_loss, attempts, scheduler_id,
    wandb_id, why (a failed or lost job's reason), log. `scheduler`: {job id: squeue state} (None: squeue did not
    answer); asked of squeue when not given."""
    sweep_dir = Path(sweep_dir)
    manifest = manifest if manifest is not None else read(sweep_dir)
    if manifest is None:
        raise FileNotFoundError(f"{sweep_dir} has no {MANIFEST}: not a sweep of lmlab (or one from before lmlab "
                                f"recorded its sweeps; `lmlab compare {sweep_dir}` reads its runs)")
    jobs = manifest["jobs"]
    if scheduler is _ASK:
        scheduler = squeue([j.get("scheduler_id") for j in jobs]) if any(j.get("scheduler_id") for j in jobs) else {}
    submitter_alive = _alive(manifest.get("submitter"))
    return [_state(sweep_dir, job, scheduler, submitter_alive) for job in jobs]


def _state(sweep_dir: Path, job: Mapping[str, Any], scheduler: Mapping[str, str] | None,
           submitter_alive: bool) -> dict[str, Any]:
    run = RunDir(sweep_dir / job["dir"])
    try:
        summary = run.read_summary()
    except ValueError:
        summary = None
    step, val_loss = _progress(run)
    queued = (scheduler or {}).get(str(job.get("scheduler_id") or "")) if scheduler is not None else None
    holder = _holder(run)
    why = None
    if job.get("state") == "failed" and job.get("error") and not holder and summary is None:
        state, why = "failed", job["error"]  # its own last word: refused before a run directory (squeue may still
        # show it RUNNING or COMPLETING while its process exits, which must not bury the reason)
    elif holder or queued in _RUNNING:
        state = "running"
    elif queued in _QUEUED:
        state = "pending"
    elif summary is not None and summary.get("status") in STATES:
        state = summary["status"]
        if state == "failed":
            why = summary.get("error")
        elif state == "interrupted" and job.get("scheduler_id") and scheduler is not None:
            why = "stopped; its checkpoint is kept"
    elif run.holds_run():
        state, why = "lost", "ended without a summary (killed, cancelled, out of memory, a lost node)"
    elif job.get("state") == "failed":  # refused before it wrote a run directory (a bad value): its own word
        state, why = "failed", job.get("error")
    elif job.get("scheduler_id"):
        if scheduler is None:
            state = "pending"  # the scheduler did not answer: it may still be queued
        else:
            state, why = "lost", f"SLURM job {job['scheduler_id']} ended before the run started"
    else:
        state = "pending" if submitter_alive else "not started"
    attempts = len((summary or {}).get("attempts") or []) + (
        state == "running" or state == "lost" and run.holds_run())  # + the one under way, or killed
    wandb = None
    with contextlib.suppress(ValueError):
        wandb = (run.read_wandb_run() or {}).get("id")
    done = summary.get("steps") if summary is not None and state not in ACTIVE else None
    return {"num": job.get("num"), "dir": job["dir"], "overrides": job.get("overrides", []), "state": state,
            "step": done if done is not None else step, "max_steps": job.get("max_steps"),
            "val_loss": _finite(val_loss if val_loss is not None else (summary or {}).get("final_val_loss")),
            "attempts": attempts, "scheduler_id": job.get("scheduler_id"), "wandb_id": wandb, "why": why,
            "log": job.get("log")}


def _holder(run: RunDir) -> str | None:
    from lmlab.record.rundir import RunLock

    return RunLock.holder(run.path)


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def counts(rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """{state: how many jobs}, in STATES' order."""
    seen = [r["state"] for r in rows]
    return {s: seen.count(s) for s in STATES if s in seen}


def table(rows: Sequence[Mapping[str, Any]], swept: Sequence[str] | None = None) -> str:
    """The status table as `lmlab sweep status` prints it: one line per job, then the counts."""
    swept = swept if swept is not None else distinct_overrides([r["overrides"] for r in rows])
    head = ("#", "job", "state", "step", "val loss", "attempts", "scheduler id")
    body = []
    for row, label in zip(rows, swept):
        total = f"/{row['max_steps']}" if row.get("max_steps") else ""
        step = f"{row['step'] if row['step'] is not None else '-'}{total}"
        loss = f"{row['val_loss']:.4f}" if row["val_loss"] is not None else "-"
        body.append((str(row["num"]), label or row["dir"], row["state"], step, loss, str(row["attempts"] or 0),
                     row["scheduler_id"] or "-"))
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = ["  ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in (head, *body)]
    notes = [f"  #{r['num']} {r['state']}: {r['why']}" + (f" (log: {r['log']})" if r.get("log") else "")
             for r in rows if r.get("why") and r["state"] in ("failed", "lost")]
    summary = ", ".join(f"{n} {s}" for s, n in counts(rows).items())
    return "\n".join([*lines, *notes, f"{len(rows)} job(s): {summary}"])


def closing_lines(sweep_dir: str | Path) -> list[str]:
    """What a sweep says when its submitter is done with it: its directory, its jobs by state and the commands that
    look at it ([] without a manifest). The scheduler is not asked: a job still queued shows as pending."""
    try:
        rows = job_states(sweep_dir, scheduler={})
    except (FileNotFoundError, ValueError):
        return []
    states = ", ".join(f"{n} {s}" for s, n in counts(rows).items())
    return [f"sweep {sweep_dir}: {len(rows)} job(s): {states}", f"  lmlab sweep status {sweep_dir}",
            f"  lmlab compare {sweep_dir}"]


def distinct_overrides(job_overrides: Sequence[Sequence[str]]) -> list[str]:
    """Each job's overrides that are not every job's: what tells the jobs of a sweep apart."""
    if not job_overrides:
        return []
    common = set.intersection(*(set(o) for o in job_overrides))
    return [" ".join(o for o in overrides if o not in common) for overrides in job_overrides]
