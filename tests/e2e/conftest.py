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


@pytest.fixture(scope="session")
def tiny_straight(corpus: Path, tmp_path_factory) -> Path:
    """The plain tiny run (`tests.runs.tiny`: 30 steps, nothing added) trained straight through, once per worker: the
    curve a stopped and resumed tiny run must end with (tests/e2e/run/test_train.py and test_interrupt.py each
    trained it again for every such test, 1.5-2 s each). Its directory is read, never written: a test that resumes or
    continues trains a run of its own. Its data cache is `tiny_straight.parent / "cache"`."""
    from lmlab import compose
    from lmlab.run.training import train
    from tests.runs import tiny

    base = tmp_path_factory.mktemp("tiny_straight")
    summary = train(compose(tiny(corpus, base / "cache")), base / "run")
    assert summary["status"] == "completed" and summary["steps"] == 30, summary
    return base / "run"
