"""Shared fixtures: one CPU thread and a fixed seed for every test, W&B offline, and a tiny GPTConfig factory."""

from __future__ import annotations

import getpass
import os
import tempfile
from pathlib import Path

# torch.compile's on-disk cache is not keyed on ATEN_CPU_CAPABILITY: kernels compiled under AVX-512 and reused under
# avx2 (or the other way) gave NaN losses and a segfault here. One cache per capability: a folder of the user's cache
# when they chose one, else beside torch's default. A cache this file chose for an outer test session (inherited by
# the `make test` that tests/e2e/project/test_setup.py runs under avx2) is keyed on that session's capability: chosen
# again.
_DEFAULT_CACHE = str(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
_OURS = "lmlab-tests-"
_chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or _DEFAULT_CACHE
if Path(_chosen).name.startswith(_OURS):
    _chosen = str(Path(_chosen).parent)
elif Path(_chosen).name.startswith(f"{Path(_DEFAULT_CACHE).name}-{_OURS}"):
    _chosen = _DEFAULT_CACHE
_capability = os.environ.get("ATEN_CPU_CAPABILITY") or "auto"
os.environ["TORCHINDUCTOR_CACHE_DIR"] = (f"{_DEFAULT_CACHE}-{_OURS}{_capability}" if _chosen == _DEFAULT_CACHE
                                         else str(Path(_chosen) / f"{_OURS}{_capability}"))

# No test reaches W&B's servers, whatever credentials the machine has; subprocesses (train.py) inherit it. Set before
# tests.runs is imported: the environment it starts with is its warm interpreter's (tests/warm.py)
os.environ["WANDB_MODE"] = "offline"

import pytest  # noqa: E402

# torch, lmlab and tests.runs (which imports Lightning: 4-5 s) are imported by the fixtures that use them, in the
# workers: pytest-xdist's controller loads this file too, before it starts the workers, and runs no test

TINY = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16)

E2E = Path(__file__).resolve().parent / "e2e"


def pytest_configure(config: pytest.Config) -> None:
    """`lmlab.compose` composes each config once per worker (tests/composed.py): installed before the test modules are
    imported, so that their `from lmlab import compose` is this one. The process ends as lmlab's commands do
    (lmlab.env.quick_exit): a worker's teardown walked torch's and Lightning's objects for 3-7 s while `make test`
    waited for it."""
    import lmlab
    from lmlab import env

    env.quick_exit()
    if os.environ.get("LMLAB_TEST_COMPOSE_CACHE") != "0":
        from tests.composed import once_per_config

        lmlab.compose = once_per_config(lmlab.compose)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first — those with a `slow` test, then the rest of tests/e2e/, then the units — so that the
    xdist workers, which take files in this order, do not end on one long file while the others idle. A file's tests
    keep their order."""

    def rank(item: pytest.Item) -> int:
        return 0 if item.get_closest_marker("slow") else 1 if item.path.is_relative_to(E2E) else 2

    first = {}
    for item in items:
        first[item.path] = min(first.get(item.path, 2), rank(item))
    items.sort(key=lambda item: first[item.path])


@pytest.fixture(autouse=True)
def _one_thread_seeded() -> None:
    """Deterministic and cheap: one intra-op thread (the test machines have two cores) and seed 0."""
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)


@pytest.fixture
def tiny_cfg():
    """`tiny_cfg(**overrides) -> GPTConfig`, resolved (its derived sizes worked out): vocab 50, 2 layers, d_model 32,
    4 heads, max_seq_len 16."""
    from lmlab.config import GPTConfig
    from lmlab.model.resolve import resolve

    def make(**overrides) -> GPTConfig:
        return resolve(GPTConfig(**{**TINY, **overrides}))

    return make


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """~60 kB of structured text in two files, for the tests that train (tests/runs.py)."""
    from tests.runs import write_corpus

    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has ended (a submitter, a lock holder that is gone)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid
