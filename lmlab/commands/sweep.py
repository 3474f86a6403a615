"""`lmlab sweep status|resume DIR`: a sweep's jobs from its manifest (sweep.json, lmlab.record.sweep), from any shell.

    lmlab sweep status multirun/2026-12-03/10-00-00            # one table: state, step of total, val loss, attempts
    lmlab sweep status DIR --json                             # the same for scripts
    lmlab sweep status DIR --watch [SECONDS]                  # refreshed until no job is pending or running
    lmlab sweep resume DIR [key=value ...]                    # run (or submit) only the jobs that did not finish

`resume` runs the sweep's own command again (as it was typed, read as data, into the same directory, from here) with the
jobs that finished (completed, diverged, collapsed) or are still queued or running left out: the failed, interrupted,
lost and never started ones run, each continuing from its own checkpoint. Twice in a row, the second finds nothing to
do. A base config that drifted from the manifest's is refused, naming the keys; the key=value arguments are the drift
meant (`trainer.max_steps=400`: more steps for every job, the completed ones continue too), and they do not rename the
jobs' directories.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from lmlab.cli import PROG, dirname_exclusions, override_key
from lmlab.record import sweep
from lmlab.record.saved import SavedStateRefused, check_command, control_char, typed_values


def parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="A sweep's jobs, from its manifest (sweep.json).")
    sub = p.add_subparsers(dest="action", required=True)
    status = sub.add_parser("status", help="one table of the sweep's jobs")
    status.add_argument("dir", type=Path, help="the sweep directory (hydra.sweep.dir)")
    status.add_argument("--json", action="store_true", help="the table as JSON, for scripts")
    status.add_argument("--watch", nargs="?", type=float, const=5.0, default=None, metavar="SECONDS",
                        help="print it again every SECONDS (5) until no job is pending or running")
    resume = sub.add_parser("resume", help="run or submit only the jobs that did not finish")
    resume.add_argument("dir", type=Path, help="the sweep directory (hydra.sweep.dir)")
    resume.add_argument("overrides", nargs="*", metavar="key=value",
                        help="the drift meant, for every job (e.g. trainer.max_steps=400)")
    return p


def run(prog: str, argv: Sequence[str]) -> None:
    args = parser(prog).parse_args(list(argv))
    try:
        manifest = sweep.read(args.dir)
    except ValueError as err:
        _refuse(prog, str(err))
    if manifest is None:
        _refuse(prog, f"{args.dir} has no {sweep.MANIFEST}: not the directory of a sweep (hydra.sweep.dir of a `-m` "
                      f"command), or a sweep from before lmlab recorded them; `lmlab compare {args.dir}` still reads "
                      f"its runs")
    if args.action == "status":
        status(args.dir, as_json=args.json, watch=args.watch)
    else:
        resume(prog, args.dir, manifest, args.overrides)


def _refuse(prog: str, message: str) -> None:
    print(f"{prog}: {message}", file=sys.stderr)
    raise SystemExit(2)


def status(sweep_dir: Path, as_json: bool = False, watch: float | None = None) -> list[dict]:
    while True:
        manifest = sweep.read(sweep_dir)
        rows = sweep.job_states(sweep_dir, manifest)
        if as_json:
            print(json.dumps({"sweep": str(sweep_dir), "command": manifest.get("command"),
                              "base_hash": manifest.get("base_hash"), "counts": sweep.counts(rows), "jobs": rows},
                             indent=2))
        else:
            if watch is not None and sys.stdout.isatty():
                print("\033[H\033[J", end="")
            print(f"{sweep_dir}  ({time.strftime('%H:%M:%S')}; {' '.join(manifest.get('command') or [])[:160]})")
            print(sweep.table(rows))
        sys.stdout.flush()
        if watch is None or not any(r["state"] in sweep.ACTIVE for r in rows):
            return rows
        time.sleep(max(watch, 0.1))


def resume(prog: str, sweep_dir: Path, manifest: dict, extra: Sequence[str]) -> None:
    import signal
    import threading

    from lmlab.commands import train
    from lmlab.run.early_signals import stop_now

    if threading.current_thread() is threading.main_thread():  # its checks (squeue, a study) end on a signal, in a line
        for signum in (signal.SIGTERM, signal.SIGINT):
            if signal.getsignal(signum) is not signal.SIG_IGN:
                signal.signal(signum, stop_now)

    rows = sweep.job_states(sweep_dir, manifest)
    # key=value arguments are for every job: the completed ones continue too (with more steps, say)
    meant = [a for a in extra if not override_key(a).startswith("hydra.")]  # (a search's n_trials: not the jobs')
    again = sweep.TO_RESUME + (("completed",) if meant else ())
    todo = [r for r in rows if r["state"] in again]
    searched = any(a.startswith(("hparams_search=", "hydra/sweeper=")) for a in manifest.get("command", []))
    if not todo and not searched:
        print(sweep.table(rows))
        print(f"{prog}: nothing to resume: every job finished or is still pending or running "
              f"({', '.join(f'{n} {s}' for s, n in sweep.counts(rows).items())})")
        return
    command = manifest.get("command")
    if not isinstance(command, list) or not command:
        _refuse(prog, f"{sweep.path_of(sweep_dir)}: no command recorded: not a manifest lmlab wrote")
    try:  # a shared sweep directory is data, not code
        typed = check_command(command[1:], sweep.path_of(sweep_dir), extra)
    except SavedStateRefused as err:
        _refuse(prog, str(err))
    typed = [a for a in typed if not override_key(a).startswith(("hydra.sweep.dir",
                                                                   "hydra.job.config.override_dirname"))]
    inside = sweep_dir.resolve()
    for row in todo:  # a job directory that is a link (or under one) would be written through, outside the sweep
        job_dir = sweep_dir / row["dir"]
        if job_dir.is_symlink() or not job_dir.resolve().is_relative_to(inside):
            _refuse(prog, f"{sweep.path_of(sweep_dir)}: job #{row['num']}'s directory {job_dir} leads outside the "
                          f"sweep ({job_dir.resolve()}): resume writes only inside {inside}")
    print(f"{prog}: {len(todo)} job(s) to run: " + ", ".join(f"#{r['num']} ({r['state']})" for r in todo), flush=True)
    keys = [override_key(a) for a in extra if "=" in a]
    excluded = [k for arg in dirname_exclusions([*typed, *extra]) for k in arg.partition("=[")[2][:-1].split(",") if k]
    names = sorted(set(excluded) | set(keys))  # the resume's own keys leave the jobs' directory names as they were
    argv = [*typed, *extra, f"hydra.sweep.dir={sweep_dir.resolve()}",
            *([f"hydra.job.config.override_dirname.exclude_keys=[{','.join(names)}]"] if names else [])]
    # It runs here, in the user's working directory, never in the manifest's `cwd` (a directory a shared manifest
    # names could hold a package every child interpreter would import): a relative path of the command is read from
    # here, which the note says when the sweep was started elsewhere
    cwd = manifest.get("cwd")
    if isinstance(cwd, str) and Path(cwd) != Path.cwd():
        relative = [a for a in typed if any(isinstance(v, str) and "/" in v and not v.startswith("/")
                                            for v in typed_values(a))]
        if relative:
            print(f"{prog}: note: the sweep was started in {cwd!r}; its relative paths ({', '.join(relative)}) are "
                  f"read from here, {Path.cwd()}", flush=True)
    sweep.RESUME = {"skip": [r["dir"] for r in rows if r["state"] not in again], "allowed": keys}
    PROG["train"] = command[0] if isinstance(command[0], str) and len(command[0]) <= 200 and not control_char(
        command[0]) else PROG["train"]
    # the process is train.py's from here (Lightning's DDP launcher starts other ranks as `python -m <main module>`)
    sys.modules["__main__"].__spec__ = train.__spec__
    sys.argv[0] = train.__file__
    try:
        train.run(PROG["train"], argv)
    finally:
        sweep.RESUME = None

