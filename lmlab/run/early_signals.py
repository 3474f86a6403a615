"""Signals from the first line: SIGUSR1 (SLURM's warning before the time limit) and SIGTERM (`scancel`, `scontrol
requeue`, a preemption) are caught from the moment an entry point starts, instead of killing the process with
nothing saved and no requeue while it imports torch and Lightning (seconds) and prepares its data.

`catch_early()` is the first call of train.py's main (and of lmlab's SLURM launcher in the job, before it unpickles
the task). A signal that comes before `train()` is kept here; lmlab.run.interrupt's `StopOnSignal` takes it over when it
is installed, and then does what it does with a signal before the run starts: stop at once (nothing is trained yet),
after a SLURM requeue for SIGUSR1. Once the run ends and StopOnSignal restores the handlers, a late signal is kept
again and the finished run exits as it would have.

A module of its own, with no import but `signal`: lmlab.run.interrupt imports torch and Lightning, the very window a
handler defined there could not cover.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

EARLY = (signal.SIGTERM, signal.SIGUSR1)
_pending: list[int] = []


def _keep(signum: int, frame: Any) -> None:
    _pending.append(int(signum))


def stop_now(signum: int, frame: Any) -> None:
    """SIGINT (Ctrl-C) before the run started: one line and the signal's exit code, not a traceback from whatever
    import or check it came in; nothing was written yet (a start writes only once its checks have passed)."""
    import os
    import sys

    print(f"interrupted by signal {signum} before the run started: nothing to save", flush=True)
    sys.stderr.flush()
    os._exit(128 + int(signum))  # not SystemExit: the exit handlers of a half-imported torch print pages of stats


def catch_early() -> None:
    """Keep SIGTERM and SIGUSR1 for StopOnSignal from now on, and stop at once on SIGINT with one line (main thread
    only: Python's rule for handlers; a SIGINT the shell set to be ignored, a background job's, stays ignored)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for s in EARLY:
        if signal.getsignal(s) is not _keep:
            signal.signal(s, _keep)
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, stop_now)


def take_pending() -> int:
    """The first signal kept since the last call (0: none); the kept ones are cleared."""
    first = _pending[0] if _pending else 0
    _pending.clear()
    return first
