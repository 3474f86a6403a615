"""optim.qk_clip in the training loop: lmlab.optim.qk_clip's clip as a Lightning callback. The step's attention inputs
are recorded in its forward, each head's max logit measured before the optimizer step (the weights that computed
them; the max over ranks), the heads over τ rescaled after it, and the two figures logged at every step."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import Callback

from lmlab.optim.qk_clip import QKClip
from lmlab.record.tracking import log_at


class QKClipCallback(Callback):
    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self.clip: QKClip | None = None

    def setup(self, trainer, pl_module, stage: str) -> None:
        if self.clip is None:
            self.clip = QKClip(pl_module.model, self.threshold, lambda t: _max_over_ranks(trainer, t))

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.clip.recording = True

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.clip.recording = False
        self.clip.measure()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if getattr(pl_module, "update_skipped", False):  # spike_skip skipped this step's update: nothing moves
            self.clip.max_logits = None
            return
        figures = self.clip.clip()  # after the step (nothing between micro-batches of one step: measured only once)
        if figures:
            log_at(trainer, figures, trainer.global_step - 1)  # the step the logits were measured at

    def teardown(self, trainer, pl_module, stage: str) -> None:
        if self.clip is not None:
            self.clip.remove()
            self.clip = None


def _max_over_ranks(trainer, t: torch.Tensor) -> torch.Tensor:
    if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        t = t.clone()
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return t
