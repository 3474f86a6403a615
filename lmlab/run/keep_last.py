"""`checkpoint.keep_last=k`: a checkpoint at each of the run's last k validations, checkpoints/step_<N>.ckpt, what
`eval.py merge=last:k` averages (lmlab.record.merge).

They sit beside best.ckpt and last.ckpt, which stay as they were: a resume reads last.ckpt (or Lightning's
hpc_ckpt_N), never a step checkpoint. What is kept is read from the directory at each save, not from a state of the
callback, so it survives a resume, a changed k, and a resume from an earlier last.ckpt: step checkpoints past the step
now saved are of the attempt that was abandoned, and go.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import Callback

from lmlab.record.rundir import RunDir


class KeepLast(Callback):
    """At each validation of a fit, save checkpoints/step_<global step>.ckpt and remove all but the newest `k`."""

    def __init__(self, run: str | Path, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"checkpoint.keep_last={k!r}: a whole number >= 1, or null (best and last only)")
        self.run, self.k = RunDir(run), k

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        from lightning.pytorch.trainer.states import TrainerFn

        if trainer.sanity_checking or trainer.fast_dev_run or trainer.state.fn != TrainerFn.FITTING:
            return
        step = trainer.global_step
        trainer.save_checkpoint(self.run.path / "checkpoints" / f"step_{step}.ckpt")  # every rank (sharded saves)
        if trainer.is_global_zero:
            found = self.run.step_checkpoints()
            newer = [p for s, p in found if s > step]  # an abandoned attempt's, after a resume from an earlier step
            older = [p for s, p in found if s <= step][:-self.k]
            for path in (*newer, *older):
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
