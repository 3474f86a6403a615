"""The encoder objectives through train.py (lmlab.model.encoder): a head=mlm run completes, its val/loss the
masked-token loss, and resumes exactly (the masks are a function of the seed and the sample); a head=classify run
fine-tuned from it on a labelled JSONL completes with the validation accuracy in summary.json; eval.py and generation
refuse the encoder."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

from tests.runs import WORDS, metric, straight_and_resumed

ROYAL = {"king", "queen", "crown"}


def _labelled(d: Path) -> tuple[Path, Path]:
    """Sentences of the corpus's words, labelled by whether a royal word is in them (a rule to learn)."""
    rng = random.Random(1)
    d.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, n in (("train", 240), ("val", 60)):
        rows = []
        for _ in range(n):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 7))]
            label = "royal" if ROYAL & set(words) else "plain"
            rows.append({"text": " ".join(words).capitalize() + ".", "label": label})
        (path := d / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        paths.append(path)
    return paths[0], paths[1]


def test_an_mlm_run_resumes_exactly_and_a_classifier_fine_tunes_from_it(corpus, tmp_path) -> None:
    from lmlab import compose
    from lmlab.analysis.evaluate import RunRefused, evaluate
    from lmlab.analysis.generate import generate_text
    from lmlab.record.rundir import load_model
    from lmlab.run.training import train

    straight, resumed = straight_and_resumed(corpus, tmp_path, "head=mlm", "position=rope")
    for name in ("train/loss", "val/loss"):
        a, b = metric(straight, name), metric(resumed, name)
        assert a.keys() == b.keys() and len(a) > 2
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-6), (name, step)
    summary = json.loads((straight / "summary.json").read_text())
    vocab = summary["model"]["vocab_size"]  # the tokenizer's and [MASK]
    assert summary["status"] == "completed" and summary["objective"] == "masked_token"
    assert summary["model"]["head"]["name"] == "mlm"
    first, last = summary["val_curve"][0][1], summary["val_curve"][-1][1]
    assert last < first < math.log(vocab) + 0.5  # it learns; at init about ln V
    with pytest.raises(RunRefused, match="head=mlm"):
        evaluate(straight)
    with pytest.raises(ValueError, match="head=mlm does not predict the next token"):
        generate_text(str(straight), "the king", max_new_tokens=3)

    train_jsonl, val_jsonl = _labelled(tmp_path / "labelled")
    run = tmp_path / "classify"
    cfg = compose(["data=labelled", f"data.path={train_jsonl}", f"data.val_path={val_jsonl}",
                   f"data.cache_dir={tmp_path / 'cache'}", "data.batch_size=8", "model.n_layer=2", "model.d_model=32",
                   "model.n_head=2", "model.max_seq_len=32", "position=rope", "head=classify",
                   f"init_from={straight}", "trainer.max_steps=100", "trainer.val_check_interval=50",
                   "trainer.log_every_n_steps=1", "trainer.enable_progress_bar=false", "schedule.warmup_steps=5",
                   "optim.lr=3e-3", "divergence.spike_factor=0",  # batches of 8: a noisy loss
                   "logger=none", "threads=1"])
    result = train(cfg, run)
    assert result["status"] == "completed" and result["objective"] == "label"
    assert result["model"]["head"]["labels"] == ["plain", "royal"]
    assert result["model"]["vocab_size"] == vocab  # the source's tokenizer and its [MASK]
    figures = json.loads((run / "classify.json").read_text())
    assert result["val_accuracy"] == figures["accuracy"] and figures["n_val"] == 60
    model = load_model(run).eval()  # the accuracy, recomputed from the saved weights and the validation file
    tok_ids = [json.loads(line) for line in val_jsonl.read_text().splitlines()]
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(run / "tokenizer.json"))
    x = torch.full((len(tok_ids), 32), vocab - 1)
    for i, row in enumerate(tok_ids):
        ids = tok.encode(row["text"]).ids[:32]
        x[i, : len(ids)] = torch.tensor(ids)
    labels = torch.tensor([["plain", "royal"].index(r["label"]) for r in tok_ids])
    with torch.no_grad():
        accuracy = float((model(x).argmax(-1) == labels).float().mean())
    assert accuracy == pytest.approx(result["val_accuracy"])
    assert metric(run, "val/accuracy")  # logged beside val/loss, the label's cross-entropy
    assert result["val_accuracy"] > result["majority_accuracy"]  # the rule is learnt past always answering plain
