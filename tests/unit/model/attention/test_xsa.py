"""attention.xsa (exclusive self-attention; the GPT-2 speedrun's record 82, gated): each head's output loses its share
along the token's own value, y − α·(y·v̂)v̂, worked by hand per head and token (GQA: the query head's own key/value
head's value); `gated` starts as the standard model (tanh(0) = 0); cached generation equals the full forward; it
trains (export=hf refuses it: tests/unit/interop/test_interop_hf.py)."""

from __future__ import annotations

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention.parts.xsa import ExclusiveSelfAttention
from lmlab.model.gpt import GPT, validate
from tests.unit.model.options import assert_cached_equals_full, assert_refused, assert_trains

TINY = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16)


def _model(**attention) -> GPT:
    torch.manual_seed(0)
    kv = attention.pop("n_kv_head", None)
    return GPT(validate(GPTConfig(**TINY, n_kv_head=kv, attention={"name": "mha", **attention})))


def test_each_head_loses_its_share_along_its_own_value_worked_by_hand() -> None:
    torch.manual_seed(0)
    y = torch.randn(2, 4, 5, 8, dtype=torch.float64)
    v = torch.randn(2, 2, 7, 8, dtype=torch.float64)  # GQA: 2 key/value heads, 2 cached positions before these 5
    full = ExclusiveSelfAttention("full", 4)(y, v)
    gated = ExclusiveSelfAttention("gated", 4)
    with torch.no_grad():
        gated.alpha.copy_(torch.tensor([0.0, 0.5, -1.0, 3.0]))
    half = gated(y, v)
    for b in range(2):
        for h in range(4):
            for i in range(5):
                own = v[b, h // 2, 2 + i]  # query head h reads key/value head h // 2; token i sits at position 2 + i
                unit = own / own.norm()
                share = y[b, h, i] @ unit
                torch.testing.assert_close(full[b, h, i], y[b, h, i] - share * unit)
                a = torch.tanh(gated.alpha[h].double())
                torch.testing.assert_close(half[b, h, i], y[b, h, i] - a * share * unit)
                assert abs(float(full[b, h, i] @ unit)) < 1e-12  # nothing left along its own value
    assert torch.equal(gated(y, v)[:, 0], y[:, 0])  # α = tanh(0): that head untouched


def test_gated_starts_as_the_standard_model_and_full_changes_it() -> None:
    plain, gated, full = _model(), _model(xsa="gated"), _model(xsa="full")
    gated.load_state_dict(plain.state_dict(), strict=False)
    full.load_state_dict(plain.state_dict(), strict=False)
    idx = torch.randint(0, 50, (2, 16))
    torch.testing.assert_close(gated(idx), plain(idx))
    assert (full(idx) - plain(idx)).abs().max() > 1e-3
    assert sorted(k for k in gated.state_dict() if "xsa" in k) == ["h.0.attn.xsa.alpha", "h.1.attn.xsa.alpha"]


@pytest.mark.parametrize("attention", [dict(name="mha"), dict(name="gqa", n_kv_head=2), dict(name="mla"),
                                       dict(name="mha", window=6)])
def test_cached_generation_gives_the_full_forward(attention: dict) -> None:
    model = _model(**attention, xsa="full")
    assert_cached_equals_full(model, torch.randint(0, 50, (2, 16)))


def test_it_trains_and_a_bad_value_is_refused_by_key() -> None:
    model = _model(xsa="gated")
    assert_trains(model, torch.randint(0, 50, (4, 16)), "xsa.alpha")
    assert_refused(["trainer.max_steps=10", "attention.xsa=sometimes"], "attention.xsa")
