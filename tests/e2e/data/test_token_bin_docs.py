"""Documents on data=token_bin: a run on shards written as the speedrun's are ([sep, *document]) trains with its
documents masked and counted from their BOS, records the separator and its role in the model record (so the loaded
model numbers the documents alike), and a resume under the other role is refused before anything is written."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab import compose
from lmlab.data.token_bin import write_shard
from tests.runs import CtrlC

SEP = 63


def _bos_shards(d: Path) -> Path:
    """Documents [SEP, k, k + 1, ...] counting up from a random k: the next token is the previous + 1 inside a
    document, and after SEP any start."""
    rng = np.random.default_rng(0)
    d.mkdir(parents=True)
    docs = [[SEP, *range(k, k + n)] for k, n in zip(rng.integers(0, 30, 1200), rng.integers(4, 30, 1200))]
    tokens = np.concatenate(docs)
    write_shard(d / "train_0.bin", tokens[: len(tokens) - 2000])
    write_shard(d / "val_0.bin", tokens[len(tokens) - 2000:])
    return d


def test_a_run_masks_bos_documents_and_a_resume_under_the_other_role_is_refused(tmp_path, monkeypatch) -> None:
    from lmlab.analysis.evaluate import load_model
    from lmlab.run.training import train

    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    d = _bos_shards(tmp_path / "shards")
    args = ["data=token_bin", f"data.train={d}/train_*.bin", f"data.val={d}/val_*.bin", "data.val_tokens=1650",
            "data.vocab_size=64", f"data.doc_sep={SEP}", "data.batch_size=8", "attention.doc_mask=true",
            "position=learned", "position.per_document=true", "model.n_layer=1", "model.d_model=32",
            "model.n_head=2", "model.max_seq_len=32", "trainer.max_steps=40", "trainer.val_check_interval=20",
            "optim.lr=1e-2", "schedule.warmup_steps=5", "logger=none", "threads=1",
            "trainer.enable_progress_bar=false", "monitor.attn_every_n_steps=0"]
    run = tmp_path / "run"
    with pytest.raises(SystemExit):
        train(compose(args), run, callbacks=[CtrlC(at=20)])
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    with pytest.raises(ValueError, match=r"model/doc_sep_role: checkpoint has 'bos', config has 'eod'"):
        train(compose([*args, "data.doc_sep_role=eod"]), run)
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before
    summary = train(compose(args), run)
    assert summary["status"] == "completed" and summary["steps"] == 40
    assert summary["final_val_loss"] < 0.5 * summary["unigram_val_loss"]  # counting inside documents is learnt
    record = json.loads((run / "summary.json").read_text())["model"]
    assert (record["eod_id"], record["doc_sep_role"]) == (SEP, "bos")
    model = load_model(run)
    assert model.documents(torch.tensor([[5, SEP, 1, 2, SEP, 3]])).tolist() == [[0, 1, 1, 1, 2, 2]]
