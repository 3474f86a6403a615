"""data.packing=padded end to end: the paragraphs command writes one document a file, experiment=batchnorm_text trains
on them with padded rows (norm=batch), the validation reads padded rows (its loss differs from the packed windows'
that eval.py's length sweep reads, as documented), and eval.py evaluates the run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lmlab import compose
from lmlab.run.training import train
from tests.runs import cli, metric

TEXT = "\n\n".join(("ROMEO.\n" + "But soft, what light " * (i % 7 + 1)) for i in range(400))


def test_padded_rows_train_and_evaluate(tmp_path: Path) -> None:
    (tmp_path / "play.txt").write_text(TEXT)
    out = cli("-m", "lmlab.data.paragraphs", str(tmp_path / "docs"), str(tmp_path / "play.txt"),
              cwd=tmp_path)
    assert "400 documents from 1 files" in out.stdout and len(list((tmp_path / "docs").glob("*.txt"))) == 400
    run = tmp_path / "run"
    overrides = ["experiment=batchnorm_text", f"data.paths=[{tmp_path / 'docs'}]", "data.packing=padded", "norm=batch",
                 f"data.cache_dir={tmp_path / 'cache'}", "model.max_seq_len=64", "trainer.max_steps=12",
                 "trainer.val_check_interval=6", "logger=none", "schedule.warmup_steps=2", "data.val_fraction=0.2"]
    summary = train(compose(overrides), run)
    assert summary["status"] == "completed" and math.isfinite(summary["final_val_loss"])
    assert len(metric(run, "val/loss")) == 2
    from lmlab.analysis.evaluate import evaluate

    result = evaluate(run)
    assert result["rows"][0]["length"] == 64 and math.isfinite(result["rows"][0]["loss"])
    assert result["rows"][0]["loss"] != pytest.approx(summary["final_val_loss"], rel=1e-3)  # packed windows, not rows
