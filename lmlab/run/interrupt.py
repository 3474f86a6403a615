"""Interruption: SIGINT, SIGTERM and SIGUSR1 end the current step, and the run stops at that step boundary.

A signal only sets a flag. After each optimizer step every rank learns whether any rank got one (one small
all-reduce when there is more than one rank), so all ranks stop after the same step and the collective
checkpoint save can't hang, whichever rank the signal went to. The save happens when the next step would start:
by then the step is finished in every way an uninterrupted run would finish it (its validation, its logged rows),
so the resumed run continues exactly. `RunInterrupted` then leaves Lightning's loop (setting `should_stop` would
make Lightning validate and end the epoch first), and `train()` writes `interrupted`; train.py exits non-zero.
Before the run starts (its checks and data preparation, which can take minutes on a new corpus) a signal stops the
process at once, with the signal's exit code: there is nothing to save, and a token-shard preparation goes on from
its finished shards next time. SIGUSR1 in a SLURM job requeues it first, so the job starts again
(lmlab.run.early_signals
keeps a signal that comes even earlier, while the entry point imports, and `install()` takes it over here).
Between the start of fit and the end of the first step a process of one rank stops at once too (`StopAtOnce`, raised
by the handler wherever the process is: assembling the first batch, compiling, stepping): no step of this attempt is
done, so there is no boundary to wait for, and waiting could take minutes; the run records `interrupted` and keeps
the checkpoint it started from. (With more ranks, the stop waits for the first step's boundary, which every rank
reaches together.) A second SIGINT (Ctrl-C pressed again) stops at once, while training; once the run is being recorded (its
checkpoint, metrics and summary) it only confirms the stop, so the record is never cut short. On one rank, a second
SIGINT after the step's optimizer step stops at that step's boundary instead: the step's bookkeeping (its row, the
schedule's step, the logging step) is not in the weights, and a checkpoint cut inside it resumed a step out of line.

Lightning registers its own SIGTERM handler (which broadcasts from inside the handler and kills the other ranks)
and, under SLURM, a SIGUSR1 handler that saves `hpc_ckpt_N.ckpt` and requeues the job. lmlab takes these signals
over so that there is one checkpoint, the newest, and does the SLURM requeue itself once that checkpoint is saved.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from lmlab.record.summary import EXIT_CODES, SIGNALS


class RunInterrupted(Exception):
    """Raised at a step boundary after the checkpoint is saved; carries the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by signal {signum}")
        self.signum = signum


class StopAtOnce(BaseException):
    """Raised by the signal handler inside fit before this attempt's first step is done (one rank): not an Exception,
    so no code on the way out takes it for a failure of its own. Carries the signal."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped at once by signal {signum}")
        self.signum = signum


class StopOnSignal(Callback):
    """Install with `install()` before fit and `restore()` after the last write; read `signum` afterwards.
    `checkpoint`: where the interrupted run's checkpoint goes."""

    def __init__(self, checkpoint: str) -> None:
        self.checkpoint = checkpoint
        self.received: int = 0  # the signal this process got (0: none)
        self.signum: int = 0  # the signal the run stopped for, the same on every rank
        self.recording = False  # set by record(): training is over, what it did is being written
        self.preparing = True  # until prepared(): before the run starts, a signal stops the process at once
        self.before_first_step = False  # inside fit, one rank, no step of this attempt done: stop at once
        self._trainer: Any = None  # set in setup: what the handler asks whether the step's optimizer step is done
        self._step_at_start = 0  # trainer.global_step when the current batch started
        self._original: dict[int, Any] = {}

    @property
    def state_key(self) -> str:
        return "StopOnSignal"

    def _handler(self, signum: int, frame: Any) -> None:
        if self.preparing:  # nothing to save yet (data preparation, checks): stop now, in one line
            stop_before_start(signum)
        if self.before_first_step:
            self.received = signum
            raise StopAtOnce(signum)
        if signum == signal.SIGINT and self.received == signal.SIGINT and not self.recording:
            if self._stepped():  # the optimizer step is done: stop when its bookkeeping is, at the boundary
                self.signum = signum
                return
            raise KeyboardInterrupt  # pressed twice: stop now
        self.received = signum

    def _stepped(self) -> bool:
        """Whether this step's optimizer step is done (one rank; with more, every rank must stop at the same point)."""
        trainer = self._trainer
        return trainer is not None and trainer.world_size == 1 and trainer.global_step > self._step_at_start

    def prepared(self) -> None:
        """The run's plan is made (its data prepared) and the run is about to start: from here on a signal ends the
        step it comes in and the run stops at that step boundary, with its checkpoint."""
        self.preparing = False

    def record(self) -> None:
        """From here on the run is being saved and recorded (checkpoint, metrics, summary): a second Ctrl-C no longer
        stops at once, so it cannot cut the record of the run it already stopped."""
        self.recording, self.before_first_step = True, False

    def _take(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (a notebook's worker, say)
        for s in SIGNALS:
            self._original.setdefault(int(s), signal.getsignal(s))
            signal.signal(s, self._handler)

    def install(self) -> StopOnSignal:
        from lmlab.run.early_signals import take_pending

        self._take()
        pending = take_pending()  # one that came while the entry point imported (lmlab.run.early_signals)
        if pending:
            self._handler(pending, None)
        return self

    def restore(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        from lmlab.run.early_signals import stop_now

        for s, handler in self._original.items():
            if handler is stop_now:  # the run has started: a late Ctrl-C is Python's again
                handler = signal.default_int_handler
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        self._original = {}

    def take_over(self, trainer) -> None:
        """Keep Lightning from registering its SIGTERM / SLURM SIGUSR1 handlers for `trainer`: between its
        registration and the first step, its SIGTERM handler would broadcast from inside the handler on the rank
        that got the signal, a collective the other ranks never join."""
        trainer._signal_connector.register_signal_handlers = lambda: None

    def setup(self, trainer, pl_module, stage: str) -> None:
        self._take()  # ours, whatever ran since install() (a caller's own handlers, say)
        self._trainer = trainer
        if stage == "fit" and trainer.world_size == 1 and not self.recording:
            if self.received:  # it came while the run was being set up (loggers, the trainer): stop now
                raise StopAtOnce(self.received)
            self.before_first_step = True

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.before_first_step = False  # a step (or its first micro-batch) is done: from here, at its boundary
        signum = self.received
        if trainer.world_size > 1:  # any rank's signal stops every rank after this same step
            flag = torch.tensor(signum, device=pl_module.device)
            signum = int(trainer.strategy.reduce(flag, reduce_op="max"))
        self.signum = signum

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._step_at_start = trainer.global_step
        if self.signum:
            self.record()  # the stop is decided: a second Ctrl-C now must not cut the checkpoint's write short
            trainer.save_checkpoint(self.checkpoint)  # collective: every rank decided the same after the last step
            raise RunInterrupted(self.signum)


def stop_before_start(signum: int) -> None:
    """A signal before the run started: nothing to save. Under SLURM, SIGUSR1 (the time-limit warning) requeues the
    job first (rank 0; every rank gets the signal and stops), so it runs again instead of ending here."""
    requeued = requeue_on_slurm(signum) if os.environ.get("SLURM_PROCID", "0") == "0" else None
    print(f"interrupted by signal {signum} before the run started: nothing to save" +
          (f"; {requeued}" if requeued else ""), flush=True)
    raise SystemExit(EXIT_CODES[int(signum)])


def requeue_on_slurm(signum: int) -> str | None:
    """After SIGUSR1 (SLURM's warning before the time limit) in a SLURM batch job, requeue it: the requeued job runs
    the same command, and `resume=auto` continues from the checkpoint just saved. Returns what was done."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if signum != signal.SIGUSR1 or not SLURMEnvironment.detect():
        return None
    array = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array else os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    try:
        result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        return f"requeue of SLURM job {job} failed ({err})"
    if result.returncode:
        return f"requeue of SLURM job {job} failed: {result.stderr.strip() or result.returncode}"
    return f"requeued SLURM job {job}"
