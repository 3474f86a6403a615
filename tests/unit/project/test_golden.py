"""Golden files (tests/golden/): the default corpus's char and BPE token ids and a tiny run's first 50 train losses and
its val losses, as pinned by `python -m tests.golden.regenerate`, and in the unit tier a fast check: 10 steps of the
default model, optimizer and schedule on a checked-in slice of the corpus's tokens (no Lightning, no corpus). A change of one token id fails, and of a loss by more
than one unit of its last pinned decimal (the float32 kernels of another x86 CPU move 4 of the 50 losses by one unit
of the 6th decimal: AVX-512 against the AVX2 machine that pinned them)."""

from __future__ import annotations

import json

import numpy as np

from tests.golden import regenerate as golden


def test_ten_steps_on_the_checked_in_slice_give_the_pinned_losses() -> None:
    """The unit tier's golden check (about 2 s): the model, its init, the loss, the optimizer and the schedule of the
    default run, each step's loss within one unit of the 6th decimal of the pinned one."""
    expected = json.loads(golden.FAST.read_text())
    assert expected["overrides"] == golden.FAST_RUN and len(expected["train/loss"]) == golden.FAST_STEPS
    actual = golden.fast_losses(np.load(golden.SLICE))
    tol = 1.5 * 10 ** -golden.DIGITS
    assert [abs(a - e) <= tol for a, e in zip(actual, expected["train/loss"], strict=True)] == [True] * len(actual), \
        (actual, expected["train/loss"])
    assert actual[-1] < actual[0] - 0.3  # it learns: a check of numbers, not of a constant
