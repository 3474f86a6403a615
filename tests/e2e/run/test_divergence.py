"""The divergence rule (lmlab.run.monitor.Divergence), on loss sequences: non-finite losses, spikes past the running
minimum, the collapse plateau at a step, and the state a resume restores."""

from __future__ import annotations


def test_every_key_a_run_writes_is_declared_in_the_typed_summary(corpus, tmp_path) -> None:
    """RunSummary is the reference for summary.json's readers: a key summarize() writes without declaring it
    (besides a task's own figures) fails here."""
    import typing

    from lmlab import compose
    from lmlab.record.summary import RunSummary
    from lmlab.run.training import train
    from tests.runs import tiny

    summary = train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=2", "trainer.val_check_interval=2",
                                 "monitor.every_n_steps=1")), tmp_path / "run")
    declared = typing.get_type_hints(RunSummary)
    assert set(summary) - set(declared) == set(), set(summary) - set(declared)
    assert {"status", "steps", "model", "config", "attempts", "signal"} <= set(summary)
