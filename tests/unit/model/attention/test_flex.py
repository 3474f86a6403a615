"""The FlexAttention path (the GPU's for windows, documents and softcaps) against the dense masks built token by token:
its forward runs on the CPU without gradients, so the masks it builds are checked here, for windows, cached prefixes
(keys that end with the last query), documents of random lengths, GQA and the softcap; and where it runs (not for CPU
training, which has no FlexAttention backward in torch 2.13)."""

from __future__ import annotations

import random

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model import flex
from lmlab.model.mask import allowed, doc_allowed, documents
from lmlab.model.gpt import GPT, validate

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


@pytest.fixture
def flex_on_cpu(monkeypatch):
    monkeypatch.setattr(flex, "FLEX_DEVICES", {"cuda", "cpu"})


def _dense(q, k, v, scale, mask, softcap=None):
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    logits = (q @ k.transpose(-2, -1)) * scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@torch.no_grad()
def test_the_flex_masks_are_the_ones_built_token_by_token() -> None:
    rng = random.Random(0)
    for case in range(20):
        B, heads, kv_heads = 2, 4, rng.choice([1, 2, 4])
        T, offset = rng.randint(1, 40), rng.choice([0, 0, rng.randint(1, 30)])
        S = rng.randint(T, offset + T)  # a windowed cache keeps only the last keys
        window = rng.choice([None, rng.randint(1, 20)])
        softcap = rng.choice([None, 2.0])
        tokens = torch.randint(0, 5, (B, offset + T), generator=torch.Generator().manual_seed(rng.randint(0, 99)))
        doc = documents(tokens, 0) if rng.random() < 0.5 else None
        docs = None if doc is None else (doc[:, offset:], doc[:, doc.size(1) - S:])
        q = torch.randn(B, heads, T, 8)
        k, v = torch.randn(B, kv_heads, S, 8), torch.randn(B, kv_heads, S, 6)
        mask = doc_allowed(allowed(T, offset, S, window, q.device), docs)
        want = _dense(q, k, v, 0.3, mask, softcap)
        got = flex.flex_attend(q, k, v, scale=0.3, offset=offset, window=window, doc=docs, softcap=softcap)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"case {case}: {m}")


def test_cpu_training_never_takes_the_flex_path(flex_on_cpu) -> None:
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    assert flex.use_flex(q.detach()) and not flex.use_flex(q)  # no FlexAttention backward on the CPU in torch 2.13
    with torch.no_grad():
        assert flex.use_flex(q)


def test_the_cpu_keeps_lmlabs_own_paths_by_default() -> None:
    assert not flex.use_flex(torch.randn(1, 2, 4, 8))


@pytest.mark.parametrize("attention", [{"name": "mha", "window": 5, "doc_mask": True},
                                       {"name": "gqa", "window": 4, "pattern": ["local", "global"], "softcap": 2.0},
                                       {"name": "mla", "doc_mask": True, "softcap": 3.0},
                                       {"name": "diff", "window": 6}])
def test_a_model_gives_the_same_logits_through_flex(attention: dict, monkeypatch) -> None:
    cfg = validate(GPTConfig(vocab_size=30, n_layer=2, d_model=32, n_head=4, n_kv_head=2, max_seq_len=24,
                             attention=attention, eod_id=0))
    torch.manual_seed(0)
    model = GPT(cfg).eval()
    idx = torch.randint(0, 30, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        banded = model(idx)
        monkeypatch.setattr(flex, "FLEX_DEVICES", {"cuda", "cpu"})
        calls = []
        real = flex.flex_attend
        monkeypatch.setattr("lmlab.model.attention.score.flex_attend", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
        through_flex = model(idx)
    assert calls  # the masked layers went through FlexAttention
    torch.testing.assert_close(through_flex, banded, rtol=1e-5, atol=1e-5)
