"""The training progress bar: Lightning's own, without an epoch count that a step-based run doesn't have.

train.py trains for `trainer.max_steps` on an endless loader, so Lightning's `max_epochs` is -1 and its Rich bar
read "Epoch 0/-2". This bar says "Epoch 0" there and keeps everything else (the step count, speed, metrics).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE


class StepsRichProgressBar(RichProgressBar):
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs >= 0:  # an epoch budget: "Epoch e/E"
            return super()._get_train_description(current_epoch)
        return f"Epoch {current_epoch}".ljust(len(self.validation_description))  # padded as Lightning pads


def progress_bar() -> ProgressBar:
    """What Lightning would pick (Rich when installed, else tqdm), labelled for step-based training."""
    return StepsRichProgressBar() if _RICH_AVAILABLE else TQDMProgressBar()
