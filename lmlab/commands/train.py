"""`lmlab train` / `python train.py` [group=option ...] [key=value ...] — train one GPT variant (see README).

`main` returns the run's objective (lmlab.record.summary.objective: the best val loss, +inf for a run that diverged,
collapsed
or failed), which Hydra's sweepers optimise (`-m hparams_search=optuna`).

`ledger=<file>` (lmlab.record.ledger): however the run ends — completed, diverged, collapsed, interrupted, failed, or
refused before it started (a bad value or key; exit code 2 as always) — its row is appended to the file and printed as
the last line of stdout, `LEDGER {...}` (one line per job of a sweep, before the sweep's closing lines)."""

from __future__ import annotations

import contextlib
import io
import math
import os
import socket
import sys
import time
from collections.abc import Sequence

import hydra
from omegaconf import DictConfig

import lmlab  # noqa: F401  (registers the config resolvers)
from lmlab.cli import PROG, TYPED, dirname_exclusions, quote_paths
from lmlab.commands.refusals import refuse_unknown, usage_errors
from lmlab.commands.train_ledger import LEDGER_ROWS, ledger_row, typed_ledger, typed_overrides, typed_run_dir
from lmlab.env import plain_warnings, quick_exit
from lmlab.run.early_signals import catch_early


def run(prog: str, argv: Sequence[str]) -> None:
    """The command line `prog argv...` (sweep job dirs hold '=' and ',', and non-ASCII paths are quoted for Hydra)."""
    catch_early()  # SIGUSR1/SIGTERM from here on: kept until train() installs its handler (lmlab.run.early_signals)
    quick_exit()  # lmlab.env: a refusal too ends without the teardown's walks over torch
    plain_warnings(prog.removeprefix("python "))  # lmlab's own warnings: one line each
    PROG["train"] = prog
    # the interpreters it starts (DDP ranks: `python -m lmlab.commands.train` or the script) import nothing from the
    # working directory, which may be a shared run or sweep directory (Python >= 3.11; lmlab.env.child_python too)
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    argv = quote_paths(argv, ("init_from", "hydra.run.dir"))
    TYPED["train"] = list(argv)
    sys.argv = [sys.argv[0], *argv, *dirname_exclusions(argv)]
    ledger_file = typed_ledger(argv)  # ledger=<file> as typed: a refusal before Hydra composes the config has a row
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said) if ledger_file else contextlib.nullcontext():
            refuse_unknown("train", "train", sys.argv[1:])  # one line for a misspelt group, option or key
    except SystemExit:
        print(said.getvalue(), end="", file=sys.stderr)
        ledger_row(ledger_file, typed_run_dir(argv), typed_overrides(argv), "refused",
                    error=said.getvalue().strip().removeprefix(f"{prog.removeprefix('python ')}: "))
        raise
    print(said.getvalue(), end="", file=sys.stderr)
    try:
        main()
    except SystemExit as stop:  # Hydra's own refusal of the command line, before main ran (its words on stderr)
        if ledger_file and not LEDGER_ROWS and stop.code not in (0, None):
            ledger_row(ledger_file, typed_run_dir(argv), typed_overrides(argv), "refused",
                        error=f"{prog} exited {stop.code} before the run started (Hydra's message is on stderr)")
        raise
    if SWEEPS:  # a sweep's last lines (its jobs ran in this process): where it is, how its jobs ended, what next
        from lmlab.record.sweep import closing_lines

        print("\n".join(line for d in SWEEPS for line in closing_lines(d)), flush=True)
    if FAILED_JOBS:  # a sweep went on past them (the basic launcher's jobs run in this process): now it says so
        jobs = "\n  ".join(FAILED_JOBS)
        print(f"{prog.removeprefix('python ')}: {len(FAILED_JOBS)} job(s) of the sweep did not run to an end:\n  {jobs}",
              file=sys.stderr)
        raise SystemExit(1)


# The jobs of this process's sweep that were refused or raised (directory: why); run() exits 1 when there are any.
FAILED_JOBS: list[str] = []
SWEEPS: list[str] = []  # the sweep directories whose jobs ran in this process: run() ends with their closing lines


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
@usage_errors("train")
def main(cfg: DictConfig) -> float:
    catch_early()  # again in a launcher's job process, which runs main() without run() (submitit's, say)
    from hydra.core.hydra_config import HydraConfig

    hc = HydraConfig.get()
    sweeping = hc.mode.name == "MULTIRUN"
    if sweeping and str(hc.sweep.dir) not in SWEEPS:
        SWEEPS.append(str(hc.sweep.dir))
    from lmlab.record import ledger
    from lmlab.record.summary import objective

    ledger_file = ledger.target(cfg)  # ledger=<file>: every end of this run appends its row (a bad path is refused)
    started, horizon = time.time(), None
    overrides = [str(o) for o in hc.overrides.task]
    try:
        cfg, overrides = continued(cfg, hc)
        ledger_file = ledger.target(cfg)  # (a continued run's own ledger=, or this command's)
        checked = None  # the meta model the checks built: train() neither checks nor builds it again
        if not sweeping:  # a bad value is refused before Lightning is imported (a sweep's job records it, goes on)
            from lmlab.run.checks import check_config

            checked = check_config(cfg, overrides)
        from lmlab.record.tracking import hydra_group
        from lmlab.run.training import train
        from lmlab.run.wall import wall_horizon

        group = hydra_group(hc)  # the W&B group: the sweep's (or the run's), named by lmlab.record.tracking
        job_event(hc, "running", host=socket.gethostname(), pid=os.getpid())
        horizon = wall_horizon(cfg)  # budget.wall: the schedule's decay fitted to the seconds (lmlab.run.wall)
        summary = train(cfg, hc.runtime.output_dir, overrides=overrides, group=group, hydra=hc,
                        callbacks=[horizon] if horizon is not None else None, checked=checked)
        job_event(hc, summary["status"], steps=summary["steps"])
    except BaseException as err:
        if ledger_file is not None:
            try:
                ledger_row(ledger_file, hc.runtime.output_dir, overrides, None, error=err, started=started,
                            horizon=horizon)
            except OSError as why:  # the run's own error is the one to report
                print(f"{PROG['train'].removeprefix('python ')}: ledger={ledger_file}: no row written: {why}",
                      file=sys.stderr)
        if not sweeping or not isinstance(err, Exception):
            raise
        job_event(hc, "failed", error=str(err).splitlines()[0] if str(err) else type(err).__name__)
        # a refusal (nothing written) is one line; a failure is recorded in its summary.json, with its traceback here
        if isinstance(err, ValueError | FileNotFoundError):
            print(f"{PROG['train'].removeprefix('python ')}: {hc.runtime.output_dir}: {err}", file=sys.stderr)
        else:
            import traceback

            traceback.print_exc()
        FAILED_JOBS.append(f"{hc.runtime.output_dir}: {str(err).splitlines()[0] if str(err) else type(err).__name__}")
        return math.inf  # the worst value a search can see, not an error that ends it; the sweep goes on
    print(f"{summary['status']}: step {summary['steps']}, {_val_line(summary)} -> {hc.runtime.output_dir}/summary.json")
    if ledger_file is not None:
        ledger_row(ledger_file, hc.runtime.output_dir, overrides, summary["status"], summary=summary,
                    horizon=horizon)
    from lmlab.env import is_rank_zero

    if summary["status"] == "interrupted" and is_rank_zero():  # schedulers and `&&` chains must see it unfinished
        from lmlab.record.summary import EXIT_CODES  # (rank 0 only: Lightning's DDP launcher kills all on a child's
                                                     # error)

        raise SystemExit(EXIT_CODES.get(summary.get("signal") or 0, 1))  # a signal also stops a sweep
    return objective(summary)


def job_event(hc, state: str, **fields) -> None:
    """A sweep's job says how it is doing in the sweep's manifest (lmlab.record.sweep; rank zero only)."""
    from lmlab.env import is_rank_zero

    if hc.mode.name == "MULTIRUN" and is_rank_zero():
        from lmlab.record.sweep import job_event as record

        record(hc.sweep.dir, hc.runtime.output_dir, state, **fields)


def continued(cfg: DictConfig, hc) -> tuple[DictConfig, list[str]]:
    """A run directory that holds a run is continued with its own overrides, this command's on top (`python train.py
    hydra.run.dir=<run> trainer.max_steps=1200` needs nothing else typed again); an architecture the command changes is
    refused by the resume's checks, naming the key. `resume=false` starts over, from this command alone."""
    from omegaconf import OmegaConf

    from lmlab.cli import merge_overrides
    from lmlab.record.rundir import RunDir

    overrides = OmegaConf.to_container(hc.overrides.task, resolve=False)  # `${oc.env:KEY}` kept, not its secret
    if str(cfg.get("resume", "auto")).lower() == "false":
        return cfg, overrides
    saved = RunDir(hc.runtime.output_dir).read_overrides(overrides)  # data: refused before anything is built
    if saved is None:
        return cfg, overrides
    merged = merge_overrides(saved, overrides)
    if merged == overrides:
        return cfg, overrides
    return hydra.compose(config_name="train", overrides=merged), merged


def _val_line(summary: dict) -> str:
    """`val loss 1.8652 (unigram 3.3426)` to 4 decimals, or what the run has instead (interrupted before any
    validation: no val loss yet)."""
    loss, unigram = summary.get("final_val_loss"), summary.get("unigram_val_loss")
    head = "no val loss yet" if loss is None else f"val loss {loss:.4f}"
    return head if unigram is None else f"{head} (unigram {unigram:.4f})"


if __name__ == "__main__":  # how Lightning's DDP launcher starts the other ranks of `lmlab train` (lmlab/commands)
    run("lmlab train", sys.argv[1:])

