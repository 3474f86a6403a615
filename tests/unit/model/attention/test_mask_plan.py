"""Masks built once (issue 60): within one forward each distinct FlexAttention block mask is built once and shared
by every layer that uses it (it was built in every layer of every forward); a mask that depends on no data (a window,
a softcap's causal mask) is built once per shape, across forwards; one that reads the batch (documents) once per
forward. The logits are the dense masks' as before."""

from __future__ import annotations

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model import flex
from lmlab.model.gpt import GPT, validate

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _model(attention: dict, n_layer: int = 4) -> GPT:
    cfg = validate(GPTConfig(vocab_size=30, n_layer=n_layer, d_model=32, n_head=4, n_kv_head=2, max_seq_len=24,
                             attention=attention, eod_id=0))
    torch.manual_seed(0)
    return GPT(cfg).eval()


def _built(model: GPT, idx: torch.Tensor, monkeypatch) -> tuple[torch.Tensor, int, list]:
    """(logits through FlexAttention, block masks built, FlexAttention calls) of one forward."""
    monkeypatch.setattr(flex, "FLEX_DEVICES", {"cuda", "cpu"})
    calls = []
    real = flex.flex_attend
    monkeypatch.setattr("lmlab.model.attention.score.flex_attend", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    before = flex.BUILT["block_masks"]
    with torch.no_grad():
        logits = model(idx)
    monkeypatch.setattr(flex, "FLEX_DEVICES", {"cuda"})
    return logits, flex.BUILT["block_masks"] - before, calls


@pytest.mark.parametrize("attention, distinct", [
    ({"name": "mha", "window": 5}, 1),  # one window, four layers
    ({"name": "gqa", "window": 4, "pattern": ["local", "local", "local", "global"], "softcap": 2.0}, 2),  # 2 kinds
    ({"name": "mha", "window": 5, "pattern": ["local", "global"], "doc_mask": True}, 2),  # documents in each
    ({"name": "mla", "doc_mask": True, "softcap": 3.0}, 1),
])
def test_each_distinct_mask_is_built_once_per_forward(attention: dict, distinct: int, monkeypatch) -> None:
    flex.clear_masks()
    model = _model(attention)
    idx = torch.randint(1, 30, (2, 24), generator=torch.Generator().manual_seed(1))
    idx[:, 9] = 0  # an end of document in each row
    with torch.no_grad():
        dense = model(idx)
    logits, built, calls = _built(model, idx, monkeypatch)
    assert len(calls) == 4 and built == distinct  # every layer through FlexAttention, each mask built once
    torch.testing.assert_close(logits, dense, rtol=1e-5, atol=1e-5)
    again, rebuilt, _ = _built(model, idx, monkeypatch)
    assert rebuilt == (distinct if attention.get("doc_mask") else 0)  # data-free masks: once per shape
    torch.testing.assert_close(again, dense, rtol=1e-5, atol=1e-5)


def test_another_batch_of_documents_gets_its_own_mask(monkeypatch) -> None:
    flex.clear_masks()
    model = _model({"name": "mha", "window": 5, "doc_mask": True}, n_layer=2)
    gen = torch.Generator().manual_seed(2)
    for ends in (3, 15):
        idx = torch.randint(1, 30, (2, 24), generator=gen)
        idx[:, ends] = 0
        with torch.no_grad():
            dense = model(idx)
        logits, built, _ = _built(model, idx, monkeypatch)
        assert built == 1
        torch.testing.assert_close(logits, dense, rtol=1e-5, atol=1e-5)
