"""attention.select_blocks (MoBA's top-k block selection): against attention worked per head and query by hand in
float64 (each past block scored by q·mean(K), its own block always read causally, the top k − 1 past ones, a
softmax over the keys read); with k at least the number of blocks it is full causal attention; under GQA the block
means are the key/value head's; documents narrow it further; cached generation equals the full forward; the
monitor's weights read only the selected keys; the refusals by key; a composed model trains."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT, validate
from tests.unit.model.options import assert_cached_equals_full, assert_refused, assert_trains

B, T, C, NH = 2, 13, 16, 4
HS = C // NH


def _model(k: int, size: int = 3, n_kv_head: int | None = None, eod_id: int | None = None) -> GPT:
    cfg = GPTConfig(vocab_size=30, n_layer=2, d_model=C, n_head=NH, max_seq_len=32, position={"name": "none"},
                    attention={"name": "gqa" if n_kv_head else "mha", "select_blocks": k, "select_block_size": size,
                               "doc_mask": eod_id is not None}, n_kv_head=n_kv_head, eod_id=eod_id)
    torch.manual_seed(0)
    return GPT(validate(cfg)).eval()


def _by_hand(attn: torch.nn.Module, x: torch.Tensor, k_blocks: int, size: int) -> torch.Tensor:
    """The layer's output, each head and query on its own: its blocks scored, picked, a softmax over their keys."""
    nkv = attn.n_kv_head
    W = attn.c_attn.weight.double()
    q = (x @ W[:NH * HS].T).view(B, T, NH, HS)
    k = (x @ W[NH * HS:(NH + nkv) * HS].T).view(B, T, nkv, HS)
    v = (x @ W[(NH + nkv) * HS:].T).view(B, T, nkv, HS)
    y = torch.zeros(B, T, NH, HS, dtype=torch.float64)
    for b in range(B):
        for h in range(NH):
            g = h // (NH // nkv)
            for t in range(T):
                own = t // size
                scores = {i: float(q[b, t, h] @ k[b, i * size:(i + 1) * size, g].mean(0)) for i in range(own)}
                past = sorted(scores, key=scores.get, reverse=True)[:k_blocks - 1]
                keys = [j for j in range(t + 1) if j // size == own or j // size in past]
                logits = torch.stack([q[b, t, h] @ k[b, j, g] / math.sqrt(HS) for j in keys])
                y[b, t, h] = F.softmax(logits, 0) @ v[b, keys, g]
    return y.reshape(B, T, C) @ attn.c_proj.weight.double().T


@pytest.mark.parametrize("k, size, n_kv_head", [(2, 3, None), (3, 2, None), (2, 4, 2), (1, 3, None)])
def test_it_is_the_top_k_blocks_by_hand(k: int, size: int, n_kv_head: int | None) -> None:
    attn = _model(k, size, n_kv_head).double().h[0].attn
    x = torch.randn(B, T, C, dtype=torch.float64)
    pos = _model(k, size, n_kv_head).double().pos
    with torch.no_grad():
        torch.testing.assert_close(attn(x, pos), _by_hand(attn, x, k, size))


def test_with_every_block_it_is_full_causal_attention() -> None:
    sparse, full = _model(5, 3), _model(1, 3)
    full_cfg = GPTConfig(vocab_size=30, n_layer=2, d_model=C, n_head=NH, max_seq_len=32, position={"name": "none"},
                         attention={"name": "mha"})
    torch.manual_seed(0)
    dense = GPT(validate(full_cfg)).eval()
    dense.load_state_dict(sparse.state_dict())
    idx = torch.randint(0, 30, (B, T))
    with torch.no_grad():
        torch.testing.assert_close(sparse(idx), dense(idx), rtol=1e-5, atol=1e-5)  # 5 blocks of 3 cover 13 tokens
        assert not torch.allclose(full(idx), dense(idx), rtol=1e-3, atol=1e-3)  # one block: its own only


def test_cached_generation_gives_the_full_forward_and_the_monitor_reads_the_selected_keys() -> None:
    model = _model(2, 3)
    assert_cached_equals_full(model, torch.randint(0, 30, (B, 16)))
    attn = model.h[1].attn
    x = torch.randn(B, T, C)
    weights, _ = attn.probs(x, model.pos)
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, NH, T))
    read = (weights > 0).sum(-1)  # at most its own block's (t mod 3 + 1) and one past block's 3 keys
    bound = torch.tensor([min(t + 1, t % 3 + 1 + 3) for t in range(T)])
    assert (read <= bound).all() and (read == bound).all()


def test_documents_narrow_the_selection() -> None:
    model = _model(2, 3, eod_id=3)
    idx = torch.randint(4, 30, (B, T))
    idx[:, 6] = 3
    cut = idx.clone()
    cut[:, :6] = torch.randint(4, 30, (B, 6))  # the first document changed, its end at 6 kept: the second reads none
    with torch.no_grad():
        torch.testing.assert_close(model(idx)[:, 7:], model(cut)[:, 7:])


def test_refused_by_key_and_trains() -> None:
    base = ["trainer.max_steps=1000", "attention.select_blocks=2"]
    assert_refused([*base, "attention.window=16"], r"attention\.select_blocks=2 with attention\.window=16")
    assert_refused([*base, "attention.score=relu2"], r"attention\.select_blocks=2 needs attention\.score=softmax")
    assert_refused([*base, "attention=diff"], r"attention\.select_blocks=2 acts through the attention's select")
    assert_refused(["trainer.max_steps=1000", "attention.select_block_size=8"],
                   r"attention\.select_block_size=8 .* set attention\.select_blocks")
    assert_trains(_model(2, 4), torch.randint(0, 30, (4, 16)), "attn.c_attn", steps=50)  # <= 8 keys a query


def test_a_query_reads_at_most_k_blocks_and_the_gate_costs_its_scores() -> None:
    """keys_read: k·size whatever the context (a window's W under attention.window); extra_flops: 2·d per block's
    mean key and query head, and one add per key number for the means."""
    attn = _model(2, 4).h[0].attn
    assert [attn.keys_read(n) for n in (4, 8, 100)] == [4, 8, 8]
    assert attn.extra_flops(100) == 2 * NH * HS * 25 + NH * HS  # 25 blocks of 4 over 100 tokens
    cfg = GPTConfig(vocab_size=30, n_layer=2, d_model=C, n_head=NH, max_seq_len=32, attention={"name": "mha",
                                                                                                "window": 6})
    windowed = GPT(validate(cfg)).h[0].attn
    assert [windowed.keys_read(n) for n in (4, 100)] == [4, 6] and windowed.extra_flops(100) == 0
