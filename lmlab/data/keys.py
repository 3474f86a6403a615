"""The keys every corpus shares, typed: checked before training (lmlab.run.checks, which imports no Lightning) and when
the data module is built."""

from __future__ import annotations

from typing import Annotated, Literal

from lmlab.registry import NonNegativeFloat, NonNegativeInt, PositiveInt, Range

# The keys every corpus shares (conf/data_base/corpus.yaml), typed like an option's keys: checked before training
# (lmlab.run.checks.check_config) and at construction. A task (data=position_probe) has the loader's keys only.
DATA_KEYS = {"batch_size": PositiveInt, "vocab_size": PositiveInt,
             "val_fraction": Annotated[float, Range(gt=0, lt=1)], "val_windows": PositiveInt | None,
             "num_workers": NonNegativeInt, "num_proc": PositiveInt | None, "tokenizer_sample": PositiveInt | None,
             "shard_size": PositiveInt, "eod": str | None, "packing": Literal["packed", "padded"],
             "batch_schedule": list | None, "seq_schedule": list | None, "batch_lr_power": NonNegativeFloat}
SCHEDULE_KEYS = ("batch_schedule", "seq_schedule", "batch_lr_power")  # lmlab.data.stages: read by the loop too
# A data module's `seed` is the run's data seed (lmlab.run.seeds): so a resume's warning names it
DATA_SEED = "data seed (seeds.data, else seed)"
SHARD_KEYS = {k: DATA_KEYS[k] for k in ("num_proc", "tokenizer_sample", "shard_size", "eod")}  # the shards' recipe
