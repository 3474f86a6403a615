"""The Lightning callbacks a data module hands the training loop (its `callbacks(run_dir)`, lmlab.data.tasks): how a
task measures itself at every validation. The data modules themselves know nothing of Lightning, so eval.py,
generate.py and compare read data without importing it; only these, which training alone imports, do.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from lmlab import names


class TaskFigures(Callback):
    """At every validation (not the sanity check): the task's measurement of the model, kept as `task.last` (what
    summary.json records), logged under `task.logged` and written to `path` (rank 0). `task`: a
    lmlab.data.synthetic.SyntheticTask, or a data module that measures itself as one does (data=labelled)."""

    def __init__(self, task: Any, path: Path) -> None:
        self.task, self.path = task, path

    @torch.no_grad()
    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        result = self.task.measure(trainer, pl_module)
        self.task.last = result
        for name, key in self.task.logged.items():
            pl_module.log(name, torch.tensor(result[key]))
        if trainer.is_global_zero:
            from lmlab.record.rundir import atomic_write

            atomic_write(self.path, json.dumps(result, indent=1))


class SourceLosses(Callback):
    """val/loss/<source>: each validation batch's loss (LitGPT.validation_step returns it) logged under its source,
    averaged over the source's blocks as val/loss is over all of them; the last validation's values are kept for
    summary.json (`data.last`; `data`: a lmlab.data.mixture.MixtureDataModule)."""

    def __init__(self, data: Any) -> None:
        self.data = data

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if outputs is None or len(batch) < 3:
            return
        source = self.data.sources[int(batch[2][0])].name
        pl_module.log(names.val_loss(source), outputs, sync_dist=True, batch_size=batch[0].size(0))

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        metrics = trainer.callback_metrics
        self.data.last = {s.name: float(metrics[names.val_loss(s.name)]) for s in self.data.sources
                          if names.val_loss(s.name) in metrics}
