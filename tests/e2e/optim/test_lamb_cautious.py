"""LAMB's trust ratio and cautious weight decay, each by hand; schedule-free's modes and evaluation weights."""

from __future__ import annotations

import pytest


def test_lamb_under_fsdp2_follows_one_process(corpus, tmp_path) -> None:
    """The trust ratio's norms are whole-tensor norms: on FSDP2's row shards (DTensors) torch reduces them across the
    ranks, so 2 CPU ranks with 4 sequences each take one process's steps on the same 8 (measured: equal to 1e-7)."""
    from tests.runs import metric, one_and_two_ranks, tiny

    args = [a for a in tiny(corpus, tmp_path / "cache", "optim=lamb", "trainer.max_steps=10")
            if not a.startswith("data.batch")]
    one, two = one_and_two_ranks(args, tmp_path, "fsdp2")
    a, b = metric(one, "train/loss"), metric(two, "train/loss")
    assert a.keys() == b.keys() and len(a) == 10
    assert list(b.values()) == pytest.approx(list(a.values()), rel=1e-5)
    assert a[9] < a[0]
