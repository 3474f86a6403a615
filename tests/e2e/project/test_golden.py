"""Golden files (tests/golden/): the default corpus's char and BPE token ids and a tiny run's first 50 train losses and
its val losses, as pinned by `python -m tests.golden.regenerate`, and in the unit tier a fast check: 10 steps of the
default model, optimizer and schedule on a checked-in slice of the corpus's tokens (no Lightning, no corpus). A change of one token id fails, and of a loss by more
than one unit of its last pinned decimal (the float32 kernels of another x86 CPU move 4 of the 50 losses by one unit
of the 6th decimal: AVX-512 against the AVX2 machine that pinned them)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tests.golden import regenerate as golden

E2E = pytest.mark.e2e  # prepares the default corpus (pip fetch on first use) and trains a run


def same_losses(expected: dict[str, dict[str, float]], actual: dict[str, dict[str, float]]) -> list[str]:
    """The (figure, step) pairs whose loss differs by more than one unit of the last pinned decimal (both rounded)."""
    tol = 1.5 * 10 ** -golden.DIGITS
    return [f"{name} step {step}: {actual[name].get(step)} != {value}" for name in ("train/loss", "val/loss")
            for step, value in expected[name].items()
            if actual[name].get(step) is None or abs(actual[name][step] - value) > tol] + [
        f"{name}: steps {sorted(set(actual[name]) ^ set(expected[name]))}" for name in ("train/loss", "val/loss")
        if set(actual[name]) != set(expected[name])]


@E2E
def test_the_default_corpus_tokenizes_to_the_pinned_ids() -> None:
    expected = json.loads(golden.TOKENS.read_text())
    assert golden.token_hashes() == expected
    assert np.array_equal(golden.corpus_slice(), np.load(golden.SLICE))  # the fast check's slice is the corpus's
    tokens = np.arange(1000) % 85  # one token changed changes the hash the test compares
    changed = tokens.copy()
    changed[500] += 1
    assert golden._sha256(tokens) != golden._sha256(changed)


@E2E
def test_a_tiny_run_logs_the_pinned_losses() -> None:
    expected = json.loads(golden.LOSSES.read_text())
    assert len(expected["train/loss"]) == 50 and len(expected["val/loss"]) == 2
    actual = golden.tiny_run_losses()
    assert actual["overrides"] == expected["overrides"]
    assert same_losses(expected, actual) == []
    step, value = next(iter(expected["train/loss"].items()))
    for digit in range(1, golden.DIGITS):  # one digit changed, in any decimal but the last, is caught
        bumped = {**actual, "train/loss": {**actual["train/loss"], step: round(value + 10 ** -digit, 8)}}
        assert same_losses(expected, bumped) == [f"train/loss step {step}: {bumped['train/loss'][step]} != {value}"]
