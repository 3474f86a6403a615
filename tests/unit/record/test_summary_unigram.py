"""summary.json's loss against the unigram entropy, under names that say what they are: the difference (what
compare calls loss_vs_unigram) and the ratio, with the ratio's old name kept for the scripts that read it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmlab import compose
from lmlab.run.training import train
from tests.runs import tiny


def test_the_difference_and_the_ratio_by_hand(corpus: Path, tmp_path: Path) -> None:
    summary = train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=4")), tmp_path / "run")
    final, unigram = summary["final_val_loss"], summary["unigram_val_loss"]
    assert summary["val_loss_minus_unigram"] == pytest.approx(final - unigram, abs=1e-12)
    assert summary["val_loss_over_unigram"] == pytest.approx(final / unigram, rel=1e-12)
    assert summary["val_loss_vs_unigram"] == summary["val_loss_over_unigram"]  # the old name: the ratio, as before
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert on_disk["val_loss_minus_unigram"] == summary["val_loss_minus_unigram"]
