"""Document masking (attention.doc_mask): in a packed block each token reads only the earlier tokens of its own
document. The documents are numbered from the end-of-document tokens; every path (SDPA, the banded window, the
explicit scores) is checked against a mask built by hand token by token over documents of random lengths; a RoPE
model's outputs on a document inside a packed block are its outputs on that document alone; the KV cache gives the
full forward's logits; a run trains and evaluates with it."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lmlab import compose
from tests.runs import tiny


def test_a_run_trains_and_evaluates_with_documents_masked(corpus: Path, tmp_path: Path) -> None:
    from lmlab.analysis.evaluate import load_model
    from lmlab.run.training import train

    run = tmp_path / "run"
    summary = train(compose(tiny(corpus, tmp_path / "cache", "data.eod='<|endoftext|>'", "attention.doc_mask=true",
                                 "position=rope", "trainer.max_steps=10", "trainer.val_check_interval=10")), run)
    assert summary["status"] == "completed" and summary["final_val_loss"] < summary["unigram_val_loss"] + 1
    record = json.loads((run / "summary.json").read_text())["model"]
    assert record["attention"]["doc_mask"] is True and record["eod_id"] is not None
    model = load_model(run)
    assert model.cfg.eod_id == record["eod_id"] and model.documents(torch.tensor([[record["eod_id"], 1]])) is not None
