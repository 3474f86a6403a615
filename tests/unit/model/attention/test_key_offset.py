"""attention.key_offset (the GPT-2 speedrun's partial key offset, record 49): after the rotation, the keys' unrotated
dims are the previous position's (the first token keeps its own), the rotated dims, queries and values untouched;
a document's first token keeps its own under doc_mask; cached generation equals the full forward; refused by key
where no dim is left unrotated, and under MLA."""

from __future__ import annotations

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention.parts.key_offset import shift_keys
from lmlab.model.gpt import GPT, validate
from tests.unit.model.options import assert_cached_equals_full, assert_refused, assert_trains

TINY = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16)


def _model(key_offset: bool, n_kv_head: int | None = None, **attention) -> GPT:
    torch.manual_seed(0)
    return GPT(validate(GPTConfig(**TINY, n_kv_head=n_kv_head, position={"name": "rope", "rotary_pct": 0.5},
                                  attention={"name": "mha", "key_offset": key_offset, **attention})))


@pytest.mark.parametrize("kv", [None, 2])
def test_the_unrotated_key_dims_are_the_previous_positions(kv: int | None) -> None:
    plain, shifted = _model(False, kv), _model(True, kv)
    shifted.load_state_dict(plain.state_dict())
    x = torch.randn(2, 9, 32)
    attn, moved = plain.h[0].attn, shifted.h[0].attn
    q0, k0, v0 = attn.qkv(x, plain.pos)
    q1, k1, v1 = moved.qkv(x, shifted.pos)
    rot = plain.pos.rot_dim
    assert 0 < rot < attn.head_dim  # rotary_pct 0.5: half the dims stationary
    torch.testing.assert_close(q1, q0)
    torch.testing.assert_close(v1, v0)
    torch.testing.assert_close(k1[..., :rot], k0[..., :rot])  # the rotated dims: their own
    torch.testing.assert_close(k1[..., 1:, rot:], k0[..., :-1, rot:])  # key t: key t − 1's stationary dims
    torch.testing.assert_close(k1[..., :1, rot:], k0[..., :1, rot:])  # the first token keeps its own
    assert (shifted(torch.randint(0, 50, (2, 9))) - plain(torch.randint(0, 50, (2, 9)))).abs().max() > 0


def test_a_documents_first_token_keeps_its_own_and_the_cache_carries_the_last_one() -> None:
    torch.manual_seed(0)
    k = torch.randn(1, 2, 6, 8)
    doc = torch.tensor([[0, 0, 0, 1, 1, 1]])
    out = shift_keys(k, 4, 0, doc, None)
    want = k.clone()
    want[..., [1, 2, 4, 5], 4:] = k[..., [0, 1, 3, 4], 4:]  # position 3 opens document 1: its own
    torch.testing.assert_close(out, want)
    # the same six keys in two forwards through a cache: the second's first key takes the first's last
    from lmlab.model.attention.cache import LayerCache

    layer = LayerCache()
    parts = [shift_keys(k[..., :4, :], 4, 0, None, layer), shift_keys(k[..., 4:, :], 4, 4, None, layer)]
    torch.testing.assert_close(torch.cat(parts, dim=-2), shift_keys(k, 4, 0, None, None))


@pytest.mark.parametrize("attention", [dict(), dict(n_kv_head=2), dict(window=6)])
def test_cached_generation_gives_the_full_forward(attention: dict) -> None:
    model = _model(True, attention.pop("n_kv_head", None), **attention)
    assert_cached_equals_full(model, torch.randint(0, 50, (2, 16)))


def test_it_trains_and_is_refused_where_no_dim_is_left_unrotated() -> None:
    assert_trains(_model(True), torch.randint(0, 50, (4, 16)), "attn.c_attn")
    assert_refused(["trainer.max_steps=10", "attention.key_offset=true"],
                   "attention.key_offset=true .* position=learned")
    assert_refused(["trainer.max_steps=10", "attention.key_offset=true", "position=rope"], "rotary_pct=1.0 leaves none")
    assert_refused(["trainer.max_steps=10", "attention=mla", "attention.key_offset=true", "position=rope",
                    "position.rotary_pct=0.5"], "attention.key_offset=true")
