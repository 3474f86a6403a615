"""lm-eval on a run, offline, on small local tasks (JSONL files defined here): its loglikelihoods equal lmlab's own
scoring of the same continuations, on both routes (the HF export read by lm-eval's HFLM, and LmlabLM over lmlab's
own model for architectures transformers cannot represent)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
pytest.importorskip("lm_eval")

from lmlab import compose  # noqa: E402
from lmlab.analysis.evaluate import load_model  # noqa: E402
from lmlab.analysis.harness import run_harness  # noqa: E402
from lmlab.run.training import train  # noqa: E402
from tests.runs import ROOT, cli, tiny  # noqa: E402

QUESTIONS = [
    {"question": "The king shall", "choices": ["speak.", "hear.", "sword"], "answer": 0},
    {"question": "Thou lord of the", "choices": ["night.", "day.", "queen"], "answer": 1},
    {"question": "Love not", "choices": ["thee.", "the crown.", "death"], "answer": 2},
]
TEXTS = [{"text": "The queen will speak not. The lord shall hear thee."}, {"text": "Death and love."}]


@pytest.fixture(scope="module")
def tasks(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tasks")
    (d / "mc.jsonl").write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (d / "ppl.jsonl").write_text("".join(json.dumps(t) + "\n" for t in TEXTS))
    (d / "mc.yaml").write_text(f"""task: lmlab_toy_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'mc.jsonl'}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
""")
    (d / "ppl.yaml").write_text(f"""task: lmlab_toy_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {d / 'ppl.jsonl'}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
""")
    return d


def _own_loglikelihood(model, tok, context: str, continuation: str) -> float:
    """lmlab's scoring: the model's log-probabilities of the continuation's tokens after the context's."""
    whole, ctx = tok.encode(context + continuation).ids, tok.encode(context).ids
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([whole[:-1]]))[0].float(), dim=-1)
    return float(sum(logp[i - 1, whole[i]] for i in range(len(ctx), len(whole))))


def _own_rolling(model, tok, text: str) -> float:
    ids = [tok.encode("\n").ids[0], *tok.encode(text).ids]  # conditioned on a newline (no begin-of-text token)
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].float(), dim=-1)
    return float(sum(logp[i - 1, ids[i]] for i in range(1, len(ids))))


@pytest.mark.parametrize("arch,route", [((), "hf"), (("position=alibi",), "lmlab")])
def test_harness_loglikelihoods_equal_lmlabs_own(corpus: Path, tmp_path: Path, tasks: Path, arch, route) -> None:
    run = tmp_path / "run"
    train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=30", "model.max_seq_len=64", *arch)), run)
    results = run_harness(run, ["lmlab_toy_mc", "lmlab_toy_ppl"], include=str(tasks), log_samples=True)
    assert results["lmlab_route"] == route
    from tokenizers import Tokenizer

    model, tok = load_model(run), Tokenizer.from_file(str(run / "tokenizer.json"))
    samples = results["samples"]["lmlab_toy_mc"]
    assert len(samples) == len(QUESTIONS)
    for sample in samples:
        for (context, continuation), resp in zip((a for a in sample["arguments"]), sample["resps"]):
            assert continuation.startswith(" ")  # lm-eval's target delimiter
            ll = resp[0][0]
            assert ll == pytest.approx(_own_loglikelihood(model, tok, context, continuation), abs=1e-4)
    for sample in results["samples"]["lmlab_toy_ppl"]:
        text = sample["doc"]["text"]
        assert sample["resps"][0][0] == pytest.approx(_own_rolling(model, tok, text), abs=1e-3)
    acc = results["results"]["lmlab_toy_mc"]["acc,none"]
    assert 0 <= acc <= 1 and math.isfinite(results["results"]["lmlab_toy_ppl"]["word_perplexity,none"])


def test_eval_py_harness(corpus: Path, tmp_path: Path, tasks: Path) -> None:
    run = tmp_path / "run"
    train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=10", "trainer.val_check_interval=10",
                       "model.max_seq_len=64")), run)
    res = cli(str(ROOT / "eval.py"), f"run={run}", "harness=lmlab_toy_mc", f"harness_include={tasks}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "lmlab_toy_mc" in res.stdout and "acc" in res.stdout
    saved = json.loads((run / "eval" / "harness.json").read_text())
    assert "lmlab_toy_mc" in saved["results"] and saved["route"] == "hf"


def test_the_example_tasks_run_as_the_readme_says(corpus: Path, tmp_path: Path) -> None:
    """examples/lm_eval/: the README's task YAML files, run from the checkout's root as the README's command does."""
    run = tmp_path / "run"
    train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=3", "trainer.val_check_interval=3",
                       "model.max_seq_len=128")), run)
    res = cli(str(ROOT / "eval.py"), f"run={run}", "harness=shakespeare_mc,shakespeare_ppl",
              "harness_include=examples/lm_eval", cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads((run / "eval" / "harness.json").read_text())["results"]
    assert 0 <= results["shakespeare_mc"]["acc,none"] <= 1 and "acc_norm,none" in results["shakespeare_mc"]
    assert math.isfinite(results["shakespeare_ppl"]["word_perplexity,none"])
    assert results["shakespeare_ppl"]["bits_per_byte,none"] > 0
