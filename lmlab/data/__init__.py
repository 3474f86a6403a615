"""Data pipeline: corpus (`corpus.py`) -> tokenizer (`tokenizer.py`) -> `TextDataModule` (`datamodule.py`).

`TextDataModule` is imported on first use, so tokenizer-only users (eval, tools) don't pay for importing Lightning.
"""

from __future__ import annotations

from typing import Any

from lmlab.data.corpus import CORPORA, shakespeare_files, text_files
from lmlab.data.tokenizer import TOKENIZERS, build_tokenizer, load_tokenizer

__all__ = [
    "CORPORA",
    "TASKS",
    "TOKENIZERS",
    "TextDataModule",
    "build_datamodule",
    "build_tokenizer",
    "load_tokenizer",
    "shakespeare_files",
    "text_files",
]


TASKS = {"position_probe"}  # synthetic tasks with their own data module; every other data.name is a corpus


def build_datamodule(data: dict[str, Any], *, seq_len: int, seed: int) -> Any:
    """The data module for the composed `data` group (a plain dict): the position probe (`probe.py`) for
    `data=position_probe`, `TextDataModule` over a corpus for every other option."""
    if data.get("name") == "position_probe":
        from lmlab.data.probe import PositionProbeDataModule as Module
    else:
        from lmlab.data.datamodule import TextDataModule as Module
    return Module(data, seq_len=seq_len, seed=seed)


def __getattr__(name: str) -> Any:
    if name == "TextDataModule":
        from lmlab.data.datamodule import TextDataModule

        return TextDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
