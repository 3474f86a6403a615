"""attention.paired_heads (paired head attention, the GPT-2 speedrun's record 58): heads h and h + n_head/2 read both
heads' keys in one softmax over their interleaved slots, rotated at the slots' positions, worked by hand per head,
token and slot (GQA: key/value pairs alike; a window counts slots) and checked against the record's own views at
n_head = 2; causal; cached generation equals the full forward; it trains; refused by key where it cannot apply."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT, validate
from tests.unit.model.options import assert_cached_equals_full, assert_refused, assert_trains

TINY = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16)
ROPE = {"name": "rope", "layout": "pairs", "rotary_pct": 0.5}  # the record's: adjacent pairs, half the dims rotated
TOL = dict(rtol=1e-5, atol=1e-5)
E = 3  # the end-of-document token of the document-mask case


def _model(n_head: int = 4, n_kv_head: int | None = None, position: dict = ROPE, **attention) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(**{**TINY, "n_head": n_head}, n_kv_head=n_kv_head, position=position, eod_id=E,
                    attention={"name": "gqa" if n_kv_head else "mha", "paired_heads": True, **attention})
    model = GPT(validate(cfg)).eval()
    with torch.no_grad():  # sharp attention: at init it is nearly uniform and hides mistakes
        for name, p in model.named_parameters():
            if name.endswith("attn.c_attn.weight"):
                p.mul_(4)
    return model


def _turn(x: torch.Tensor, p: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """x (..., d) rotated at position p as the record's `rotary` does it: factor1·x + factor2·x_flip, adjacent pairs,
    the dims past the rotated ones at frequency 0. The record negates the odd dims' sin (a turn by −θ, the mirror
    image: the same model with W_q's and W_k's odd rows negated); lmlab's RoPE turns by +θ, so the even dims here."""
    d = x.size(-1)
    freq = torch.cat((inv_freq.repeat_interleave(2), inv_freq.new_zeros(d - 2 * inv_freq.numel())))
    factor1, factor2 = torch.cos(p * freq), torch.sin(p * freq)
    factor2[0::2] *= -1
    x_flip = x.view(*x.shape[:-1], d // 2, 2).flip(-1).view(x.shape)
    return factor1 * x + factor2 * x_flip


def _by_hand(attn, x: torch.Tensor, inv_freq: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """The layer's output worked per query head h, token t and key slot: h's pair j = h mod P (P = n_head/2) and slot
    a = h div P, so its query sits at slot 2t + a, rotated there; it reads, for each token s and member b, key/value
    head j div g + b·n_kv_head/2 (g = n_head / n_kv_head) at slot 2s + b, rotated there, when 2s + b <= 2t + a (and
    within the last `window` slots); one softmax over all of them."""
    B, T, _ = x.shape
    nh, nkv, d = attn.n_head, attn.n_kv_head, attn.head_dim
    P, g = nh // 2, nh // nkv
    q, k, v = attn.c_attn(x).split(attn.c_attn.fused, dim=-1)
    q, k, v = q.view(B, T, nh, d), k.view(B, T, nkv, d), v.view(B, T, nkv, d)
    y = torch.zeros(B, T, nh, d)
    for h in range(nh):
        j, a = h % P, h // P
        for t in range(T):
            query = _turn(q[:, t, h], 2 * t + a, inv_freq)
            logits, values = [], []
            for s in range(T):
                for b in (0, 1):
                    i, m = 2 * t + a, 2 * s + b  # the query's slot, the key's
                    if m > i or (window is not None and i - m >= window):
                        continue
                    head = j // g + b * nkv // 2
                    logits.append((query * _turn(k[:, s, head], m, inv_freq)).sum(-1) * attn.scale)
                    values.append(v[:, s, head])
            weights = torch.stack(logits, dim=-1).softmax(dim=-1)  # (B, keys read)
            y[:, t, h] = torch.einsum("bn,bnd->bd", weights, torch.stack(values, dim=1))
    return attn.c_proj(y.reshape(B, T, nh * d))


@pytest.mark.parametrize("case", [dict(), dict(n_kv_head=2), dict(n_head=8, n_kv_head=4, window=5)],
                         ids=["mha", "gqa", "gqa-window"])
def test_a_pair_reads_both_heads_keys_in_one_softmax_worked_by_hand(case: dict) -> None:
    model = _model(**case)
    attn, x = model.h[0].attn, torch.randn(2, 7, 32)
    with torch.no_grad():
        out = attn(x, model.pos)
        want = _by_hand(attn, x, model.pos.inv_freq, case.get("window"))
        plain = _model(**case, paired_heads=False).h[0].attn(x, model.pos)
    torch.testing.assert_close(out, want, **TOL)
    assert (out - plain).abs().max() > 1e-3  # pairing changes the layer


def test_the_records_own_views_give_the_same_at_two_heads() -> None:
    """The record's code path: q and k viewed (B, T, n_head/2, 2d) and rotated by the record's paired-head table (first
    d dims at 2t, the next d at 2t + 1), then all three viewed as (B, 2T, n_head/2, d) and causal attention over the
    2T slots. It rotates head h at 2t + (h mod 2), which is h's slot only at n_head = 2 (the module's docstring)."""
    model = _model(n_head=2)
    attn, x = model.h[0].attn, torch.randn(1, 9, 32)
    B, T, d = 1, 9, attn.head_dim
    q, k, v = attn.c_attn(x).split(attn.c_attn.fused, dim=-1)
    q, k, v = (t.reshape(B, T, 2, d) for t in (q, k, v))
    q, k = q.view(B, T, 1, 2 * d), k.view(B, T, 1, 2 * d)
    v = v.reshape(B, 2 * T, 1, d)
    inv_freq = model.pos.inv_freq
    rotate = [torch.cat((_turn(t[:, s, :, :d], 2 * s, inv_freq), _turn(t[:, s, :, d:], 2 * s + 1, inv_freq)), -1)
              for t in (q, k) for s in range(T)]
    q, k = torch.stack(rotate[:T], dim=1), torch.stack(rotate[T:], dim=1)
    q, k = q.view(B, 2 * T, 1, d), k.view(B, 2 * T, 1, d)
    y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True, scale=attn.scale)
    want = attn.c_proj(y.transpose(1, 2).reshape(B, T, 2 * d))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, model.pos), want.detach(), **TOL)


@pytest.mark.parametrize("attention", [dict(), dict(window=3)], ids=["full", "window"])
def test_a_future_token_leaves_earlier_outputs_unchanged(attention: dict) -> None:
    model = _model(**attention)
    idx = torch.randint(4, 50, (2, 16))
    changed = idx.clone()
    changed[:, 9] = (idx[:, 9] + 1) % 46 + 4
    with torch.no_grad():
        before, after = model(idx), model(changed)
    torch.testing.assert_close(after[:, :9], before[:, :9], rtol=0, atol=1e-6)
    assert (after[:, 9:] - before[:, 9:]).abs().max() > 1e-4


@pytest.mark.parametrize("case", [dict(), dict(n_kv_head=2), dict(window=5),
                                  dict(window=4, pattern=["local", "global"]), dict(doc_mask=True),
                                  dict(key_offset=True), dict(name="cosine"),
                                  dict(paired_heads=[1]), dict(position={"name": "rope", "per_document": True})],
                         ids=["mha", "gqa", "window", "pattern", "doc_mask", "key_offset", "cosine", "layer_1",
                              "per_document"])
def test_cached_generation_gives_the_full_forward(case: dict) -> None:
    model = _model(**case)
    idx = torch.randint(4, 50, (2, 16))
    idx[0, [3, 11]] = E  # documents end mid-prompt and mid-generation
    idx[1, 7] = E
    assert_cached_equals_full(model, idx)
    assert ["paired_heads" in layer.attn.parts for layer in model.h] == ([False, True] if "paired_heads" in case else [True, True])


def test_the_monitors_weights_are_folded_onto_the_tokens() -> None:
    model = _model(window=5)
    weights, peak = model.h[0].attn.probs(torch.randn(2, 8, 32), model.pos)
    assert weights.shape == (2, 4, 8, 8) and peak.shape == (2, 4)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 8))
    assert not weights.triu(1).any()  # no later token
    assert not weights[..., 4:, 0].any()  # a window of 5 slots: token 4's queries (slots 8, 9) read no slot of 0


def test_it_trains_and_what_it_cannot_pair_is_refused_by_key() -> None:
    assert_trains(_model(), torch.randint(0, 50, (4, 16)), "attn.c_attn")
    base = ["trainer.max_steps=1000", "attention.paired_heads=true"]
    assert_refused([*base, "attention=mla"], r"attention=mla caches a latent .*: attention.paired_heads=true does not apply")
    assert_refused([*base, "attention=mqa"], r"attention.paired_heads=true pairs the key/value heads .* \(got 1\)")
    assert_refused([*base, "position=alibi"], r"attention.paired_heads=true with position=alibi")
    assert_refused([*base, "attention.sinks=true"], r"attention.sinks=true: .* leave it at its default")
    assert_refused(["trainer.max_steps=1000", "attention.paired_heads=[0,9]"], r"\[9\] are not layers of model.n_layer")
