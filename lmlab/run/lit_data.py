"""Lightning's face of an lmlab data module (lmlab.data: TextDataModule, a task's), which knows nothing of Lightning so
that eval.py, generate.py and compare read data without importing it.

The face hands Lightning the data's loaders, preparation and checkpoint state, and gives the data the trainer it
runs under (its `trainer`: the step and ranks that place the batches). Lightning keys a data module's state in a
checkpoint by its class's `__qualname__`: the face takes the data class's, so a checkpoint keeps the key it had when
the data modules were Lightning's own (`TextDataModule`, ...) and lmlab.run.plan.check_same_data finds it there.
"""

from __future__ import annotations

import functools
from typing import Any

import lightning.pytorch as pl


class LitData(pl.LightningDataModule):
    """`data` to Lightning: its preparation, loaders and checkpoint state; Lightning's trainer to it."""

    def __init__(self, data: Any) -> None:
        self.data = data  # before Lightning's __init__, which sets `trainer`
        super().__init__()

    @property
    def trainer(self) -> pl.Trainer | None:
        return self.data.trainer

    @trainer.setter
    def trainer(self, trainer: pl.Trainer | None) -> None:
        self.data.trainer = trainer

    def prepare_data(self) -> None:
        self.data.prepare_data()

    def setup(self, stage: str) -> None:
        self.data.setup(stage)

    def train_dataloader(self) -> Any:
        return self.data.train_dataloader()

    def val_dataloader(self) -> Any:
        return self.data.val_dataloader()

    def state_dict(self) -> dict[str, Any]:
        return self.data.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state)


@functools.cache
def _face(cls: type) -> type[LitData]:
    return type(cls.__name__, (LitData,), {"__qualname__": cls.__qualname__, "__module__": __name__})


def lightning_data(data: Any) -> LitData:
    """`data` as a LightningDataModule, under its own class's name (the checkpoint's key of its state)."""
    return _face(type(data))(data)
