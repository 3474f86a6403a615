"""Shared fixtures: one CPU thread and a fixed seed for every test, W&B offline, and a tiny GPTConfig factory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.resolve import resolve
from tests.runs import write_corpus

TINY = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16)

# No test reaches W&B's servers, whatever credentials the machine has; subprocesses (train.py) inherit it.
os.environ["WANDB_MODE"] = "offline"


@pytest.fixture(autouse=True)
def _one_thread_seeded() -> None:
    """Deterministic and cheap: one intra-op thread (the test machines have two cores) and seed 0."""
    torch.set_num_threads(1)
    torch.manual_seed(0)


@pytest.fixture
def tiny_cfg():
    """`tiny_cfg(**overrides) -> GPTConfig`, resolved (its derived sizes worked out): vocab 50, 2 layers, d_model 32,
    4 heads, max_seq_len 16."""

    def make(**overrides) -> GPTConfig:
        return resolve(GPTConfig(**{**TINY, **overrides}))

    return make


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~60 kB of structured text in two files, for the tests that train (tests/runs.py)."""
    return write_corpus(tmp_path_factory.mktemp("corpus"))
