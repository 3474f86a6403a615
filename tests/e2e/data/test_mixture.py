"""data=mixture through train.py's path: a run of two sources of different styles trained 4 steps and continued to 8
logs the same metrics.csv as 8 straight (train/loss, val/loss and val/loss/<source> at every step), records the
per-source losses and the weights in summary.json and its config, and `eval.py compare=` shows the per-source
table; eval.py's loss per length reads the run back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmlab import compose
from tests.runs import metric_rows, write_corpus
from tests.unit.data.test_mixture import write_code


def _args(prose: Path, code: Path, cache: Path, *extra: str) -> list[str]:
    sources = f"{{prose: {{paths: [{prose}], weight: 0.7}}, code: {{paths: [{code}], weight: 0.3}}}}"
    return ["data=mixture", f"data.sources={sources}", f"data.cache_dir={cache}", "data.batch_size=4",
            "data.val_windows=8", "model.n_layer=1", "model.d_model=32", "model.n_head=2", "model.max_seq_len=32",
            "optim.lr=1e-2", "schedule=constant", "schedule.warmup_steps=0", "trainer.max_steps=8",
            "trainer.val_check_interval=2", "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false",
            "monitor.every_n_steps=2", "monitor.attn_every_n_steps=0", "logger=none", "threads=1", *extra]


def test_a_mixture_run_continued_from_4_to_8_steps_logs_what_8_straight_do(tmp_path: Path) -> None:
    import typing

    from lmlab.analysis.compare import compare
    from lmlab.analysis.evaluate import evaluate
    from lmlab.record.summary import RunSummary
    from lmlab.run.training import train

    prose, code, cache = write_corpus(tmp_path / "prose"), write_code(tmp_path / "code"), tmp_path / "cache"
    straight, resumed = tmp_path / "sweep" / "straight", tmp_path / "sweep" / "resumed"
    summary = train(compose(_args(prose, code, cache)), straight)
    first = train(compose(_args(prose, code, cache, "trainer.max_steps=4")), resumed)
    assert first["status"] == "completed" and first["steps"] == 4
    again = train(compose(_args(prose, code, cache, "resume=true")), resumed)
    assert again["status"] == "completed" and again["steps"] == 8 and summary["steps"] == 8

    a, b = metric_rows(straight), metric_rows(resumed)
    columns = ("train/loss", "val/loss", "val/loss/prose", "val/loss/code")
    assert sorted(s for s, r in a.items() if "train/loss" in r) == list(range(8))
    validated = sorted(s for s, r in a.items() if "val/loss" in r)
    assert len(validated) == 4  # after steps 2, 4, 6, 8 (Lightning's logging step: 1, 3, 5, 7)
    assert validated == sorted(s for s, r in a.items() if "val/loss/prose" in r and "val/loss/code" in r)
    for step, row in a.items():
        for c in columns:
            if c in row:
                assert float(b[step][c]) == pytest.approx(float(row[c]), rel=1e-5, abs=1e-7), (step, c)
    assert {s for s, r in a.items() if "val/loss/prose" in r} == {s for s, r in b.items() if "val/loss/prose" in r}

    last = max(s for s, r in a.items() if "val/loss" in r)
    losses = summary["final_val_loss_by_source"]
    assert losses == pytest.approx({"prose": float(a[last]["val/loss/prose"]), "code": float(a[last]["val/loss/code"])},
                                   rel=1e-6)
    assert abs(losses["prose"] - losses["code"]) > 0.05  # two styles: two losses
    # val/loss pools the two sources' blocks (8 each here): their mean
    assert summary["final_val_loss"] == pytest.approx((losses["prose"] + losses["code"]) / 2, rel=1e-5)
    assert again["final_val_loss_by_source"] == pytest.approx(losses, rel=1e-5)
    recorded = json.loads((straight / "summary.json").read_text())
    assert set(recorded) - set(typing.get_type_hints(RunSummary)) == set()  # the mixture's keys are declared
    assert recorded["mixture"]["prose"]["weight"] == 0.7 and recorded["mixture"]["code"]["weight"] == 0.3
    assert recorded["mixture"]["prose"]["fraction"] == pytest.approx(0.7, abs=1e-4)
    assert recorded["config"]["data"]["sources"]["code"] == {"paths": [str(code)], "weight": 0.3}

    _, md = compare(tmp_path / "sweep")
    table = (tmp_path / "sweep" / "compare_sources.md").read_text()
    assert table in md and table.splitlines()[0].endswith("| val/loss | val/loss/code | val/loss/prose |")
    assert len(table.splitlines()) == 4  # the header, its rule, two runs

    rows = evaluate(str(straight), lengths=[32], scalings=["none"])["rows"]
    assert rows[0]["windows"] == 16 and rows[0]["loss"] == pytest.approx(summary["final_val_loss"], rel=1e-4)


def test_the_docs_mixture_command_trains_as_written(tmp_path: Path) -> None:
    """docs/runs.md's first data=mixture command, its two folders replaced by generated corpora and the tiny run's
    sizes added: it trains and logs each source's val loss."""
    import shlex

    from lmlab.run.training import train
    from tests.pages import PAGES, blocks
    from tests.runs import ROOT

    block = next(b for b in blocks(PAGES[ROOT / "docs" / "runs.md"], "bash") if "data=mixture" in b)
    line = block.replace("\\\n", " ").splitlines()[0]
    args = shlex.split(line.split("train.py", 1)[1])
    assert args[0] == "data=mixture" and args[1].startswith("data.sources={web:")
    web, code = write_corpus(tmp_path / "web"), write_code(tmp_path / "code")
    args = [a.replace("/data/web", str(web)).replace("/data/code", str(code)) for a in args]
    tiny = [a for a in _args(web, code, tmp_path / "cache", "trainer.max_steps=2") if not a.startswith("data.sources=")]
    summary = train(compose([*args, *tiny[1:]]), tmp_path / "run")
    assert summary["status"] == "completed" and set(summary["final_val_loss_by_source"]) == {"web", "code"}
    assert summary["mixture"]["web"]["weight"] == 0.7 and summary["mixture"]["code"]["weight"] == 0.3
    assert "val/loss/web" in metric_rows(tmp_path / "run")[1]
