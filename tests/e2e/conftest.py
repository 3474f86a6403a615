"""Everything under tests/e2e/ trains a run or starts a process (train.py, eval.py, DDP and FSDP2 ranks, sweeps,
signals, SLURM jobs): marked `e2e` here, once, so `make test` (the units) leaves it out and `make test-all` runs it."""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects: the marker must be there when it looks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)
