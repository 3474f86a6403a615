"""The options issue 63 added, as train.py runs them: a KDA hybrid whose attention layers read MoBA's top-k blocks
with a learned temperature per head trains, resumes after Ctrl-C to the uninterrupted run's metrics.csv, and its HF
export is refused in one line naming what transformers has no form for."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab.interop.hf import export
from lmlab.interop.refusal import NotRepresentable
from tests.runs import figures, straight_and_resumed

NEW = ("mixer=kda", "mixer.pattern=[kda,attention]", "position=rope", "attention.select_blocks=2",
       "attention.select_block_size=8", "attention.head_temperature=true")


def test_the_new_options_train_resume_exactly_and_their_export_is_refused_by_name(corpus: Path, tmp_path: Path) -> None:
    straight, resumed = straight_and_resumed(corpus, tmp_path, *NEW, at=12)
    ours, theirs = figures(straight), figures(resumed)
    assert len(ours) == len(theirs) and ours[0].keys() == theirs[0].keys()
    for a, b in zip(ours, theirs, strict=True):
        for key, value in a.items():
            if value or b[key]:
                assert float(b[key]) == pytest.approx(float(value), rel=1e-4, abs=1e-6), (a["step"], key)
    assert "mixer/state_norm/layer_00" in ours[0] and "attn/entropy/layer_01" in ours[0]
    with pytest.raises(NotRepresentable, match=r"mixer='kda' has no hybrid form in transformers"):
        export(straight, tmp_path / "hf")
