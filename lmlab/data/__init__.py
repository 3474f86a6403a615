"""Data pipeline: corpus (`corpus.py`) -> tokenizer (`tokenizer.py`) -> `TextDataModule` (`datamodule.py`).

`TextDataModule` is imported on first use, so tokenizer-only users (eval, tools) don't pay for importing Lightning.
"""

from __future__ import annotations

from typing import Any

from lmlab.data.corpus import CORPORA, shakespeare_files, text_files
from lmlab.data.tokenizer import TOKENIZERS, build_tokenizer, load_tokenizer

__all__ = [
    "CORPORA",
    "TOKENIZERS",
    "TextDataModule",
    "build_tokenizer",
    "load_tokenizer",
    "shakespeare_files",
    "text_files",
]


def __getattr__(name: str) -> Any:
    if name == "TextDataModule":
        from lmlab.data.datamodule import TextDataModule

        return TextDataModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
