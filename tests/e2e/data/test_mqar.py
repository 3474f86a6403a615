"""Zoology's multi-query associative recall (data=mqar, lmlab/data/mqar.py): the examples' structure, a stream
deterministic in the seed that a resume continues, fixed validation examples, the recall metric against a perfect
copier and a constant guesser, bad keys refused by name, the loss ignoring every position but the queries (chunked
too), compare's table and plot, and a short run that leaves its figures and resumes exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmlab import compose
from tests.runs import metric_rows


def _tiny_mqar(*extra: str) -> list[str]:
    return ["data=mqar", "data.n_pairs=4", "data.vocab_size=32", "data.batch_size=8", "data.val_windows=32",
            "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.max_seq_len=32", "trainer.max_steps=30",
            "trainer.val_check_interval=10", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
            "monitor.every_n_steps=5", "monitor.attn_every_n_steps=10", "schedule.warmup_steps=5", "logger=none",
            "threads=1", *extra]


def test_a_short_mqar_run_leaves_its_figures_and_resumes_exactly(tmp_path: Path) -> None:
    from lmlab.run.training import train
    from tests.runs import CtrlC

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    summary = train(compose(_tiny_mqar()), straight)
    recall = json.loads((straight / "recall.json").read_text())
    assert recall["step"] == 30 and recall["examples"] == 32 and recall["queries"] == 32 * 4
    assert summary["recall_accuracy"] == recall["accuracy"] and 0 <= recall["accuracy"] <= 1
    assert (summary["recall_chance_accuracy"], summary["recall_n_pairs"], summary["recall_step"]) == (1 / 16, 4, 30)
    assert json.loads((straight / "summary.json").read_text())["recall_accuracy"] == summary["recall_accuracy"]
    assert summary["unigram_val_loss"] == pytest.approx(math.log(16))
    a = metric_rows(straight)
    logged = sorted(s for s, r in a.items() if "recall/accuracy" in r)  # on Lightning's logging step, as val/loss
    assert len(logged) == 3 and logged == sorted(s for s, r in a.items() if "val/loss" in r)  # no sanity check
    assert float(a[logged[-1]]["recall/accuracy"]) == pytest.approx(recall["accuracy"], rel=1e-6)

    with pytest.raises(SystemExit):
        train(compose(_tiny_mqar()), resumed, callbacks=[CtrlC(at=17)])
    train(compose(_tiny_mqar("resume=true")), resumed)
    b = metric_rows(resumed)
    assert sorted(s for s, r in a.items() if "train/loss" in r) == list(range(30))
    for step, row in a.items():
        for c in ("train/loss", "val/loss", "recall/accuracy"):
            if c in row:
                assert float(b[step][c]) == pytest.approx(float(row[c]), rel=1e-5, abs=1e-7), (step, c)
    assert json.loads((resumed / "recall.json").read_text())["accuracy"] == pytest.approx(recall["accuracy"])
