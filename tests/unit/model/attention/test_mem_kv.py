"""attention.mem_kv (Burtsev et al., 2020, "Memory Transformer"; x-transformers' `attn_num_mem_kv`): M learned
key/value pairs per key/value head in front of the keys, read by every query whatever its position, window or
document, with no position (no rotation, a zero position bias). Against an explicit softmax over [memory; keys] by
hand (fp64, ALiBi's zero column); every attention path against a reference built token by token; causality; cached
generation (the memory is not cached: the cache's lengths are the tokens'); a document in a packed block reads as
alone; q/k norms, the cosine option and QK-clip treat the memory keys as keys; the refusals by key; a model composed
from YAML trains; the optimizer roles."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F

from lmlab import build_model, compose
from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.mask import documents
from lmlab.model.attention.score import SCORES, attend
from lmlab.model.gpt import GPT, validate
from lmlab.model.position import POSITIONS

B, T, C, NH, M = 2, 7, 16, 4, 3
HS = C // NH
E = 3  # the end-of-document token of these tests
TOL = dict(rtol=1e-5, atol=1e-5)


def _model(attention: dict | None = None, **kw) -> GPT:
    base = dict(vocab_size=30, n_layer=2, d_model=C, n_head=NH, max_seq_len=32, position={"name": "rope"},
                attention={"name": "mha", "mem_kv": M, **(attention or {})})
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(**{**base, **kw}))).eval()
    with torch.no_grad():  # sharp attention, the memory's share among the keys' as large as theirs
        for name, p in model.named_parameters():
            if name.endswith(("attn.c_attn.weight", "attn.kv_b.weight", "attn.q_proj.weight")):
                p.mul_(10)
    return model


@pytest.mark.parametrize("position", ["none", "alibi"])
def test_the_weights_are_a_softmax_over_the_memory_and_the_keys_by_hand(position: str) -> None:
    """softmax over [q_i·m_k/√d for the M memory keys; q_i·k_j/√d + bias_ij for j ≤ i] weighing [m_v; v]: ALiBi's
    bias is a zero column on the memory (it has no distance to the query)."""
    model = _model(n_layer=1, bias=True, position={"name": position}).double()
    attn = model.h[0].attn
    x = torch.randn(B, T, C, dtype=torch.float64)
    W, b = attn.c_attn.weight, attn.c_attn.bias
    q, k, v = (F.linear(x, W[i * C:(i + 1) * C], b[i * C:(i + 1) * C]).view(B, T, NH, HS) for i in range(3))
    bias = model.pos.attn_bias(T, x.device, x.dtype)  # (nh, T, T), -inf above the diagonal; None without ALiBi
    y = torch.zeros(B, T, NH, HS, dtype=torch.float64)
    for bb in range(B):
        for h in range(NH):
            for i in range(T):
                logits = [q[bb, i, h] @ attn.mem_k[h, m] / math.sqrt(HS) for m in range(M)]
                logits += [q[bb, i, h] @ k[bb, j, h] / math.sqrt(HS) + (0 if bias is None else bias[h, i, j])
                           for j in range(i + 1)]
                values = torch.cat((attn.mem_v[h], v[bb, :i + 1, h]))
                y[bb, i, h] = torch.stack(logits).softmax(0) @ values
    with torch.no_grad():
        torch.testing.assert_close(attn(x, model.pos), attn.c_proj(y.reshape(B, T, C)), rtol=1e-10, atol=1e-10)
        weights, _ = attn.probs(x, model.pos)  # the tokens' weights only: the memory's share is left out
    assert weights.shape == (B, NH, T, T) and not attn.sums_to_one
    assert (weights.sum(-1) < 1).all() and (weights.sum(-1) > 0).all()


def _reference(q, k, v, mk, mv, scale, offset, window, doc, bias=None):
    """Token by token: query i (at offset + i) reads every memory pair, and key j (at offset + T - S + j) when j is at
    or before it, within the window and of its document, with the position bias on the keys only."""
    Bq, h, Tq, _ = q.shape
    S, group = k.size(-2), h // k.size(1)
    out = torch.zeros(Bq, h, Tq, v.size(-1))
    for bb in range(Bq):
        for hh in range(h):
            for i in range(Tq):
                p = offset + i
                logits = [q[bb, hh, i] @ mk[hh // group, m] * scale for m in range(mk.size(1))]
                values = list(mv[hh // group])
                for j in range(S):
                    pk = offset + Tq - S + j
                    same_doc = doc is None or doc[0][bb, i] == doc[1][bb, j]
                    if pk <= p and (window is None or p - pk < window) and same_doc:
                        logits.append(q[bb, hh, i] @ k[bb, hh // group, j] * scale
                                      + (0 if bias is None else bias[hh, i, j]))
                        values.append(v[bb, hh // group, j])
                out[bb, hh, i] = torch.stack(logits).softmax(0) @ torch.stack(values)
    return out


def test_every_path_reads_the_memory_under_windows_documents_and_biases() -> None:
    """SDPA (dense mask), the banded window and the explicit path (a sink at −∞ takes it) against the reference, over
    random lengths, cached prefixes, windows, documents, GQA and ALiBi."""
    rng = random.Random(0)
    softmax = SCORES["softmax"](64)
    for case in range(12):
        heads, kv = 4, rng.choice([1, 2, 4])
        Tq, offset = rng.randint(1, 9), rng.choice([0, rng.randint(1, 8)])
        S = rng.randint(Tq, offset + Tq)
        window = rng.choice([None, rng.randint(1, 6)])
        pos = POSITIONS[rng.choice(["none", "alibi", "t5", "fire"])](16, 8, heads, 64, 64, {"name": "none"})
        tokens = torch.randint(0, 4, (2, offset + Tq), generator=torch.Generator().manual_seed(case))
        d = documents(tokens, 0) if rng.random() < 0.5 else None
        doc = None if d is None else (d[:, offset:], d[:, offset + Tq - S:])
        q, k, v = torch.randn(2, heads, Tq, 8), torch.randn(2, kv, S, 8), torch.randn(2, kv, S, 8)
        mem = torch.randn(kv, M, 8), torch.randn(kv, M, 8)
        bias = pos.attn_bias(Tq, q.device, q.dtype, offset)
        bias = None if bias is None else bias[..., offset + Tq - S:]
        want = _reference(q, k, v, *mem, 0.4, offset, window, doc, bias)
        for sink in (None, torch.full((heads,), -1e4)):  # the model refuses sinks with memory; attend takes both
            got = attend(q, k, v, softmax, 0.4, pos, offset, window=window, doc=doc, sink=sink, mem=mem)
            torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"case {case}, sink {sink is not None}: {m}")


@pytest.mark.parametrize("attention", ["mha", "gqa", "mla", "cosine"])
def test_the_model_stays_causal(attention: str) -> None:
    model = _model(attention={"name": attention}, n_kv_head=2 if attention == "gqa" else None)
    idx = torch.randint(0, 30, (B, 12))
    idx2 = idx.clone()
    idx2[:, 7:] = torch.randint(0, 30, (B, 5))
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:], atol=1e-4)


@pytest.mark.parametrize("case", [
    {},
    {"attention": {"name": "gqa", "window": 3, "pattern": ["local", "global"]}, "n_kv_head": 2,
     "position": {"name": "alibi"}},
    {"attention": {"name": "mla", "forget_gate": True}},
    {"attention": {"doc_mask": True, "window": 4, "qk_norm": True}, "eod_id": E},
])
def test_cached_generation_gives_the_full_forward_and_caches_no_memory(case: dict) -> None:
    model = _model(**{**case, "attention": {"mem_kv": M, **case.get("attention", {})}})
    idx = torch.randint(0, 30, (B, 16), generator=torch.Generator().manual_seed(3))
    idx[0, [4, 9]] = E
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(2)
        steps = [model(idx[:, :5], cache=cache), model(idx[:, 5:8], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(8, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)
    window = model.h[0].attn.window
    assert cache.length == 16 and cache.layers[0].k.size(-2) == (16 if window is None else window - 1)


@pytest.mark.parametrize("position", [{"name": "none"}, {"name": "alibi"}, {"name": "rope", "per_document": True}])
def test_a_document_in_a_packed_block_reads_as_the_document_alone(position: dict) -> None:
    """Every query reads the memory, in its document or not. Unrotated, a memory key reads under RoPE as a key at
    position 0 (R_0 = I): q_i·m varies with the query's position, so under RoPE the packed document reads as alone
    when positions count from each document's start (position.per_document)."""
    a, b, c = [5, 6, 7, 8, 9, E], [10, 11, 12, 13, 14, 15, 16, E], [17, 18, 19]
    model = _model(attention={"doc_mask": True}, eod_id=E, position=position)
    with torch.no_grad():
        inside = model(torch.tensor([a + b + c]))[:, len(a):len(a) + len(b)]
        alone = model(torch.tensor([b]))
    torch.testing.assert_close(inside, alone, **TOL)


def test_the_memory_keys_are_normed_as_keys_and_clipped_as_keys() -> None:
    """Under qk_norm the memory keys take the keys' RMS norm and gain (x-transformers does the same); under
    attention=cosine they are unit vectors; QK-clip's γ_h scales q_h·m like q_h·k."""
    attn = _model(attention={"qk_norm": True}).h[0].attn
    with torch.no_grad():
        attn.k_norm.fill_(3.0)
    torch.testing.assert_close(attn.extras(None)["mem"][0].pow(2).mean(-1).sqrt(), torch.full((NH, M), 3.0), **TOL)
    cosine = _model(attention={"name": "cosine"}).h[0].attn
    torch.testing.assert_close(cosine.extras(None)["mem"][0].norm(dim=-1), torch.ones(NH, M), **TOL)
    model = _model(position={"name": "none"})
    attn, x = model.h[0].attn, torch.randn(B, T, C)
    gamma = torch.tensor([1.0, 0.5, 0.25, 0.8])
    with torch.no_grad():
        before = attn.qkv(x, model.pos)[0] @ attn.extras(None)["mem"][0].transpose(-2, -1)  # (B, nh, T, M)
        attn.clip_logits(gamma)
        after = attn.qkv(x, model.pos)[0] @ attn.extras(None)["mem"][0].transpose(-2, -1)
    torch.testing.assert_close(after, before * gamma[:, None, None], **TOL)


@pytest.mark.parametrize("keys, message", [
    ({"name": "diff"}, rf"attention=diff .* attention\.mem_kv={M} does not apply"),
    ({"name": "talking_heads"}, rf"attention=talking_heads .* attention\.mem_kv={M} does not apply"),
    ({"score": "relu2"}, rf"attention\.mem_kv={M} needs attention\.score=softmax"),
    ({"sinks": True}, rf"attention\.mem_kv={M} with attention\.sinks=true: a memory pair is a learned sink"),
])
def test_where_it_does_not_apply_it_is_refused_by_key(keys: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _model(attention=keys)


def test_block_gau_refuses_it_by_key() -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=r"attention\.mem_kv=2: block=gau has no attention sublayer"):
        check_config(compose(["block=gau", "attention.mem_kv=2"]))


@pytest.mark.parametrize("attention", ["gqa", "mla"])
def test_a_model_composed_from_yaml_trains_and_its_weights_are_counted(attention: str) -> None:
    from lmlab.model.resolve import n_params_estimate
    from lmlab.optim import param_groups

    sizes = ["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.max_seq_len=16", "model.n_kv_head=2"]
    cfg = compose([f"attention={attention}", "attention.mem_kv=2", *sizes])
    model = build_model(cfg, vocab_size=50)
    attn = model.h[0].attn
    idx = torch.randint(0, 50, (2, 16))
    F.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    assert attn.mem_k.grad.abs().sum() > 0 and attn.mem_v.grad.abs().sum() > 0
    plain = build_model(compose([f"attention={attention}", *sizes]), vocab_size=50)
    added = model.num_params() - plain.num_params()
    assert added == 2 * (attn.mem_k.numel() + attn.mem_v.numel())
    assert n_params_estimate(model.cfg) - n_params_estimate(plain.cfg) == added
    assert model.cfg.cache_width == plain.cfg.cache_width  # parameters, not cached tokens
    roles = {id(p): g["role"] for g in param_groups(model, 0.1, by_role=True) for p in g["params"]}
    assert roles[id(attn.mem_k)] == roles[id(attn.mem_v)] == "other"  # AdamW, decayed, under optim=muon too
