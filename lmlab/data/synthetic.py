"""What lmlab's synthetic tasks share (data=position_probe, data=mqar: lmlab/data/probe.py, mqar.py): a data module
whose tokens are the words "0" .. "V−1", whose validation set is fixed, and whose own figures — measured at every
validation, logged, written to <run>/<figures_file> and read back by `eval.py compare=` — replace a corpus's loss
per length. A task subclasses `SyntheticTask` and says what it measures (`measure`), under which metric names it
logs it (`logged`) and what summary.json records (`figures`); its compare section groups runs with `variants`."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader, TensorDataset

if TYPE_CHECKING:
    import lightning.pytorch as pl


class SyntheticTask:
    """The surface the training loop reads from a data module (lmlab.run.training) that a synthetic task fills the
    same way: its word tokenizer (`vocab_size` words, `unk` for unknown ones) and its sha256, no preparation, the
    fixed validation windows (`val_inputs`) in order, and the `callbacks` that measure it."""

    trainer: Any = None  # the Lightning trainer while one runs the task (lmlab.run.lit_data): none in eval.py
    eod_id: int | None = None  # the task protocol's (lmlab.data.tasks): None until the data gives one
    labels: list[str] | None = None  # a labelled set's (head=classify's); none here
    tokenizer: Any = None  # its word tokenizer (set by __init__)
    shards: Mapping[str, Any] = MappingProxyType({})  # what a resume checks (lmlab.run.plan.check_same_data)
    corpus_sha256: str | None = None  # a text corpus's fingerprint (the same check): none here
    evaluable = False  # eval.py's loss per length is a corpus's figure: a synthetic task's are in its figures_file
    figures_file: str  # <run>/<figures_file>: the task's measurements at the last validation (JSON)
    logged: Mapping[str, str]  # metric name -> the measurement's key, logged at every validation

    def __init__(self, *, vocab_size: int, unk: str, batch_size: int) -> None:
        from tokenizers import Tokenizer, models, pre_tokenizers

        self.vocab_size, self.batch_size = int(vocab_size), int(batch_size)
        self.tokenizer = Tokenizer(models.WordLevel({str(i): i for i in range(self.vocab_size)}, unk_token=unk))
        self.tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # eval/generate read and write the task
        self.tokenizer_sha256 = hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()
        self.last: dict[str, Any] | None = None  # the latest measurement (TaskFigures)

    def val_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fixed validation windows and their targets, (val_windows, seq_len) each."""
        raise NotImplementedError

    def measure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """The task's figures of `pl_module` now, as written to its figures_file (JSON-ready)."""
        raise NotImplementedError

    def prepare_data(self) -> None:  # nothing to fetch
        pass

    def setup(self, stage: str | None = None) -> None:
        pass

    def val_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(*self.val_inputs()), batch_size=self.batch_size, shuffle=False)

    def save_tokenizer(self, path: str | Path) -> None:
        from lmlab.record.rundir import atomic_write

        atomic_write(path, self.tokenizer.to_str())

    def callbacks(self, run_dir: str | Path) -> list[Any]:
        from lmlab.data.callbacks import TaskFigures  # Lightning's: training imports it, eval.py does not

        return [TaskFigures(self, Path(run_dir) / self.figures_file)]


def check_split(split: str) -> None:
    if split not in ("train", "val"):
        raise ValueError(f"split={split!r}; choose 'train' or 'val'")


def read_figures(run_dir: str | Path, name: str) -> dict[str, Any] | None:
    """A run's <name> figures file, or None if it has none."""
    path = Path(run_dir) / name
    return json.loads(path.read_text()) if path.is_file() else None


def variants(runs: Sequence[Path], overrides: Mapping[Path, Mapping[str, str]], keys: Sequence[str], name: str
             ) -> dict[str, tuple[dict[str, str], list[dict[str, Any]]]]:
    """The runs that hold a <name> figures file, grouped by their values of `keys` (the seeds of a variant
    together): label ("k=v,..." or "run") -> (the variant's values, each run's figures)."""
    groups: dict[str, tuple[dict[str, str], list[dict[str, Any]]]] = {}
    for r in runs:
        if (figures := read_figures(r, name)) is not None:
            values = {k: overrides[r].get(k, "") for k in keys}
            label = ",".join(f"{k}={v}" for k, v in values.items()) or "run"
            groups.setdefault(label, (values, []))[1].append(figures)
    return groups
