"""Rolling log-likelihood (lmlab.run.scoring.ScoringLM.loglikelihood_rolling, what `downstream:` and `eval.py harness=`
score whole texts with) against lm-eval's own windows on the same model: lm_eval.utils.get_rolling_token_windows and
make_disjoint_window cut the text, and the model's log-probabilities are summed over them here, the way lm-eval's HFLM
scores a window (the last max_length + 1 tokens of context + continuation in, the continuation's log-probs out).
Texts shorter than the context, exactly as long, one token longer and several windows long; a last window that is
partial reads a full context before it, which a window that lost its context would not."""

from __future__ import annotations

import math
import os
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
pytest.importorskip("lm_eval")

from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from lmlab.run.checks import EXAMPLE_TASKS  # noqa: E402
from tests.runs import ROOT  # noqa: E402

L = 16  # the model's context


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """The example perplexity task's documents (examples/lm_eval/shakespeare_ppl.jsonl)."""
    import json

    return [json.loads(line)["text"] for line in (EXAMPLE_TASKS / "shakespeare_ppl.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def model_and_tokenizer():
    """A tiny GPT of context L whose weights are drawn wide (std 0.5), so that every log-prob depends on the tokens
    before it, and a character tokenizer of the example tasks' texts."""
    from lmlab.config import GPTConfig
    from lmlab.data.tokenizer import train_char
    from lmlab.model.gpt import GPT, validate

    tok = train_char([p.read_text() for p in sorted(EXAMPLE_TASKS.glob("*.jsonl"))], vocab_size=128)
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(vocab_size=tok.get_vocab_size(), n_layer=2, d_model=32, n_head=4, max_seq_len=L)))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    return model.eval(), tok


def _by_lm_eval_windows(model, tokens: list[int], prefix: int) -> float:
    """Σ log p over lm-eval's disjoint rolling windows of `tokens`, conditioned on `prefix`, each window scored as HFLM
    scores a request: the last L + 1 tokens of context + continuation, the continuation's log-probs."""
    total = 0.0
    for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
            token_list=tokens, prefix_token=prefix, max_seq_len=L, context_len=1)):
        ids = (context + continuation)[-(L + 1):]
        with torch.no_grad():
            logp = F.log_softmax(model(torch.tensor([ids[:-1]]))[0].double(), dim=-1)  # (len - 1, V)
        rows = logp[-len(continuation):]
        total += float(rows.gather(1, torch.tensor(continuation)[:, None]).sum())
    return total


def _request(text: str) -> SimpleNamespace:
    return SimpleNamespace(args=(text,))


def test_a_text_is_conditioned_on_a_newline_the_document_separator(model_and_tokenizer) -> None:
    from lmlab.run.scoring import ScoringLM

    model, tok = model_and_tokenizer
    newline = tok.encode("\n").ids
    assert len(newline) == 1 and ScoringLM(model, tok).prefix == newline[0]  # a char tokenizer has no end-of-text


@pytest.mark.parametrize("n_tokens", [1, 5, L - 1, L, L + 1, L + 5, 2 * L, 2 * L + 1, 3 * L + 7])
def test_rolling_loglikelihood_equals_the_sum_over_lm_evals_windows(model_and_tokenizer, texts, n_tokens) -> None:
    from lmlab.run.scoring import ScoringLM

    model, tok = model_and_tokenizer
    text = "\n".join(texts)[:n_tokens]  # one character a token
    tokens = tok.encode(text).ids
    assert len(tokens) == n_tokens
    ours = ScoringLM(model, tok).loglikelihood_rolling([_request(text)])[0]
    theirs = _by_lm_eval_windows(model, tokens, tok.encode("\n").ids[0])
    assert ours == pytest.approx(theirs, abs=1e-4)


def test_the_example_tasks_texts_and_their_perplexity_as_downstream_logs_it(model_and_tokenizer, texts,
                                                                            monkeypatch) -> None:
    """The example task's own documents (several windows each, the last one partial), and its metrics as the
    `downstream:` callback logs them: lm-eval's word perplexity exp(-Σ ll / Σ words) and bits per byte
    -Σ ll / (Σ bytes · ln 2), worked out here from the windows' sums."""
    from lmlab.run.downstream import Downstream
    from lmlab.run.scoring import ScoringLM

    model, tok = model_and_tokenizer
    prefix = tok.encode("\n").ids[0]
    ours = ScoringLM(model, tok).loglikelihood_rolling([_request(t) for t in texts])
    theirs = [_by_lm_eval_windows(model, tok.encode(t).ids, prefix) for t in texts]
    assert all(len(tok.encode(t).ids) > 2 * L and len(tok.encode(t).ids) % L for t in texts)  # partial last windows
    assert ours == pytest.approx(theirs, abs=1e-4)
    monkeypatch.chdir(ROOT)  # the task's data_files are relative to the checkout
    metrics = Downstream(["shakespeare_ppl"], tok, every=1).measure(model)
    ll = sum(theirs)
    words = sum(len(re.split(r"\s+", t)) for t in texts)
    n_bytes = sum(len(t.encode("utf-8")) for t in texts)
    assert metrics["downstream/shakespeare_ppl/word_perplexity"] == pytest.approx(math.exp(-ll / words), rel=1e-5)
    assert metrics["downstream/shakespeare_ppl/bits_per_byte"] == pytest.approx(-ll / n_bytes / math.log(2), rel=1e-5)
