"""Data pipeline: corpus (`corpus.py`) -> tokenizer (`tokenizer.py`) -> `TextDataModule` (`datamodule.py`).

`TextDataModule` is imported on first use, so tokenizer-only users (the shard workers, tools) don't pay for torch's data
loaders; no data module imports Lightning (lmlab.run.lit_data is their face there).
"""

from __future__ import annotations

from typing import Any

from lmlab.data.corpus import CORPORA, shakespeare_files, text_files
from lmlab.data.tokenizer import TOKENIZERS, build_tokenizer, load_tokenizer

__all__ = [
    "CORPORA",
    "TOKENIZERS",
    "TextDataModule",
    "build_datamodule",
    "build_tokenizer",
    "load_tokenizer",
    "shakespeare_files",
    "text_files",
]


def build_datamodule(data: dict[str, Any], *, seq_len: int, seed: int) -> Any:
    """The data module for the composed `data` group (a plain dict): a task's own (`lmlab.data.tasks.TASKS`), or
    `TextDataModule` over a corpus."""
    from lmlab.data import tasks  # torch: not for the shard workers and tokenizer-only users importing lmlab.data

    return tasks.build(data, seq_len=seq_len, seed=seed)


def __getattr__(name: str) -> Any:
    if name == "TextDataModule":
        from lmlab.data.datamodule import TextDataModule

        return TextDataModule
    if name == "TASKS":  # the registry of data tasks (lmlab.data.tasks), imported on first use as TextDataModule is
        from lmlab.data.tasks import TASKS

        return TASKS
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
