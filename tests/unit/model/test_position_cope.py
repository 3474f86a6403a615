"""position=cope against the paper's formula (Golovneva et al., 2024): g_ij = σ(q_i·k_j·scale), p_ij = Σ_{t=j..i} g_it,
the logit gains q_i·e[p_ij] interpolated between integer positions and clamped at npos_max − 1; numbers by hand, then
token by token in fp64. Every attention path adds the bias; in a full model: causality, the KV cache giving the full
forward's logits, a packed document reading as the document alone, forward and backward from the YAML, the refusals
(export=hf, per_document, rope_scaling) and the memory it states."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab import build_model, compose
from lmlab.config import GPTConfig
from lmlab.interop.hf_config import NotRepresentable, family
from lmlab.model.attention import ATTENTIONS
from lmlab.model.attention.cache import KVCache
from lmlab.model.mask import allowed, doc_allowed
from lmlab.model.attention.score import SCORES, attend
from lmlab.model.gpt import GPT, validate
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.registry import build

TOL = dict(rtol=1e-5, atol=1e-5)
E = 1  # the end-of-document token of the packed-document test


def _cope(head_dim: int = 2, npos_max: int = 3, n_head: int = 1):
    return build("position", POSITIONS, {"name": "cope", "npos_max": npos_max}, n_head * head_dim, head_dim, n_head,
                 64, 64, {"name": "none"}).double()


def _by_hand(q: torch.Tensor, k: torch.Tensor, e: torch.Tensor, scale: float, npos_max: int) -> torch.Tensor:
    """The formula one (i, j) at a time in Python floats: q (T, d), k (T, d), e (d, npos_max) -> (T, T), −inf past i."""
    T = q.size(0)
    out = torch.full((T, T), float("-inf"), dtype=torch.float64)
    for i in range(T):
        for j in range(i + 1):
            p = sum(1 / (1 + math.exp(-float(q[i] @ k[t]) * scale)) for t in range(j, i + 1))
            p = min(p, npos_max - 1)
            lo, hi = math.floor(p), math.ceil(p)
            z_lo, z_hi = float(q[i] @ e[:, lo]), float(q[i] @ e[:, hi])
            out[i, j] = (p - lo) * z_hi + (1 - (p - lo)) * z_lo
    return out


def test_the_bias_by_hand_half_gates_interpolation_and_the_clamp() -> None:
    """q ⊥ k: every gate σ(0) = 1/2, so p_ij = (i − j + 1)/2: 0.5, 1, 1.5, 2, then 2.5 clamped to npos_max − 1 = 2.
    z_i = a_i·(1, 3, 7) at p = 0, 1, 2, so the bias is a_i times 2 (half of 1 and 3), 3, 5 (half of 3 and 7), 7, 7."""
    a = [1.0, -2.0, 0.5, 3.0, 1.5]
    q = torch.tensor([[x, 0.0] for x in a], dtype=torch.float64)[None, None]
    k = torch.tensor([[0.0, 1.0]] * 5, dtype=torch.float64)[None, None]
    pos = _cope()
    with torch.no_grad():
        pos.pos_emb.copy_(torch.tensor([[1.0, 3.0, 7.0], [5.0, -5.0, 9.0]]))  # the second row meets q's zeros
    bias = pos.score_bias(q, k, 0.7)[0, 0]
    by_distance = {0: 2.0, 1: 3.0, 2: 5.0, 3: 7.0, 4: 7.0}  # i − j -> the bias over a_i
    for i in range(5):
        for j in range(5):
            want = a[i] * by_distance[i - j] if j <= i else float("-inf")
            assert bias[i, j].item() == pytest.approx(want, abs=1e-12), (i, j)


@pytest.mark.parametrize("npos_max", [3, 16])
def test_the_bias_is_the_formula_token_by_token(npos_max: int) -> None:
    """Random q, k, e in fp64 against the sum written out per (i, j): fractional positions everywhere, and at
    npos_max = 3 most of them clamped."""
    torch.manual_seed(0)
    T, d, nh = 7, 4, 2
    pos = _cope(head_dim=d, npos_max=npos_max, n_head=nh)
    with torch.no_grad():
        pos.pos_emb.copy_(torch.randn(d, npos_max, dtype=torch.float64))
    q, k = torch.randn(2, nh, T, d, dtype=torch.float64), torch.randn(2, nh, T, d, dtype=torch.float64)
    bias, e = pos.score_bias(q, k, d ** -0.5), pos.pos_emb.detach()
    for b in range(2):
        for h in range(nh):
            torch.testing.assert_close(bias[b, h], _by_hand(q[b, h], k[b, h], e, d ** -0.5, npos_max), rtol=1e-12,
                                       atol=1e-12)


def test_gates_all_one_give_relative_positions_counting_j_itself() -> None:
    """σ(q·k·scale) = 1 for every pair: p_ij = i − j + 1 (the key itself counts, the paper's Σ_{t=j..i}), so the bias
    is q_i·e[i − j + 1], as a relative position embedding read by the query (the diagonal reads e[1], never e[0])."""
    torch.manual_seed(0)
    T, d = 6, 4
    pos = _cope(head_dim=d, npos_max=16)
    with torch.no_grad():
        pos.pos_emb.copy_(torch.randn(d, 16, dtype=torch.float64))
    q = torch.cat((torch.full((1, 1, T, 1), 40.0), torch.randn(1, 1, T, d - 1)), dim=-1).double()
    k = torch.cat((torch.full((1, 1, T, 1), 40.0), torch.zeros(1, 1, T, d - 1)), dim=-1).double()  # q·k = 1600
    bias = pos.score_bias(q, k, 0.5)[0, 0]
    for i in range(T):
        for j in range(i + 1):
            assert bias[i, j].item() == pytest.approx(float(q[0, 0, i] @ pos.pos_emb.detach()[:, i - j + 1]), abs=1e-12)


def test_the_gates_learn_through_the_interpolation() -> None:
    """k enters the bias only through the gates: its gradient is the positions' (through the interpolation weight)."""
    torch.manual_seed(0)
    pos = _cope(head_dim=4, npos_max=8)
    with torch.no_grad():
        pos.pos_emb.copy_(torch.randn(4, 8, dtype=torch.float64))
    q = torch.randn(1, 1, 5, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 5, 4, dtype=torch.float64, requires_grad=True)
    bias = pos.score_bias(q, k, 0.5)
    bias[torch.isfinite(bias)].sum().backward()
    assert k.grad.abs().sum() > 0 and torch.isfinite(k.grad).all()


def test_a_stretch_of_keys_that_ends_at_the_query_counts_as_if_alone() -> None:
    """p_ij sums the gates of keys j .. i only, so the bias on the keys of a document or a window (a stretch that ends
    at the query) is the one of that stretch alone: no other mask is needed before the sum."""
    torch.manual_seed(0)
    T, d = 8, 4
    pos = _cope(head_dim=d, npos_max=16)
    with torch.no_grad():
        pos.pos_emb.copy_(torch.randn(d, 16, dtype=torch.float64))
    q, k = torch.randn(1, 1, T, d, dtype=torch.float64), torch.randn(1, 1, T, d, dtype=torch.float64)
    bias = pos.score_bias(q, k, 0.5)
    torch.testing.assert_close(bias[..., 3:, 3:], pos.score_bias(q[..., 3:, :], k[..., 3:, :], 0.5), rtol=0,
                               atol=1e-12)  # a document from token 3 on
    for i in range(2, T):  # a window of 3: query i reads keys i − 2 .. i
        alone = pos.score_bias(q[..., i - 2:i + 1, :], k[..., i - 2:i + 1, :], 0.5)[..., -1, :]
        torch.testing.assert_close(bias[..., i, i - 2:i + 1], alone, rtol=0, atol=1e-12)
    cached = pos.score_bias(q[..., 5:, :], k, 0.5, offset=5)  # the last 3 queries on every key, as under a KV cache
    # a matmul of 3 queries and one of 8 may round differently (AMD EPYC's AVX-512 kernels: 2e-16): fp64 tolerance
    torch.testing.assert_close(cached, bias[..., 5:, :], rtol=0, atol=1e-12)


# ---- every attention path adds it --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["causal", "cached", "gqa", "window", "docs", "relu2"])
def test_every_attention_path_adds_the_bias(case: str) -> None:
    """attend (SDPA with the bias as its mask, the banded window, the explicit scores) against softmax(q·k·scale +
    bias) @ v written out, the bias over the keys each query reads (relu2: relu(logits)² / n)."""
    torch.manual_seed(0)
    T, S, d, nh = 6, 9, 4, 2
    offset = S - T if case != "causal" else 0
    S = T if case == "causal" else S
    nkv = 1 if case == "gqa" else nh
    pos = _cope(head_dim=d, npos_max=5, n_head=nh).float()
    with torch.no_grad():
        pos.pos_emb.copy_(torch.randn(d, 5))
    q, k, v = torch.randn(2, nh, T, d), torch.randn(2, nkv, S, d), torch.randn(2, nkv, S, d)
    window = 3 if case == "window" else None
    docs = None
    if case == "docs":
        doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1, 1]])
        docs = (doc[:, offset:], doc)
    score = SCORES["relu2" if case == "relu2" else "softmax"](64)
    out = attend(q, k, v, score, 0.5, pos, offset, window=window, doc=docs)
    kk, vv = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
    reads = doc_allowed(allowed(T, offset, S, window, q.device), docs)
    logits = (q @ kk.transpose(-2, -1) * 0.5 + pos.score_bias(q, k, 0.5, offset)).masked_fill(~reads, float("-inf"))
    if case == "relu2":
        want = (torch.relu(logits.masked_fill(~reads, 0.0)) ** 2 / reads.sum(-1, keepdim=True)) @ vv
    else:
        want = logits.softmax(-1) @ vv
    torch.testing.assert_close(out, want, **TOL)


# ---- the whole model --------------------------------------------------------------------------------------------


def _sharp_model(**kw) -> GPT:
    """A 2-layer model whose attention and CoPE table are large enough that a mistake shows in the logits; npos_max 6,
    so the positions clamp within the 24 tokens."""
    base = dict(vocab_size=40, n_layer=2, d_model=32, n_head=4, max_seq_len=32, norm={"name": "rms"},
                position={"name": "cope", "npos_max": 6})
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(**{**base, **kw}))).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("attn.c_attn.weight", "attn.q_proj.weight", "attn.kv_b.weight")):
                p.mul_(10)
        model.pos.pos_emb.copy_(torch.randn_like(model.pos.pos_emb))
    return model


CACHED = {"mha": {}, "gqa": {"attention": {"name": "gqa"}, "n_kv_head": 2},
          "window": {"attention": {"name": "mha", "window": 5}},
          "relu2": {"attention": {"name": "mha", "score": "relu2"}},
          "softcap+sinks": {"attention": {"name": "mha", "softcap": 3.0, "sinks": True}},
          "forget_gate+mem_kv": {"attention": {"name": "mha", "forget_gate": True, "mem_kv": 2}},
          "diff": {"attention": {"name": "diff"}}, "mla": {"attention": {"name": "mla"}},
          "talking_heads": {"attention": {"name": "talking_heads"}}, "cosine": {"attention": {"name": "cosine"}},
          "gau": {"block": {"name": "gau"}, "activation": {"name": "silu"}}}


@pytest.mark.parametrize("case", sorted(CACHED))
def test_the_kv_cache_gives_the_full_forward(case: str) -> None:
    """A prompt of 5, then one token at a time to 24: the cached logits are the full forward's (the bias of the new
    query reads every cached key)."""
    model = _sharp_model(**CACHED[case])
    idx = torch.randint(0, 40, (2, 24))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(2)
        steps = [model(idx[:, :5], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(5, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def test_future_tokens_do_not_change_earlier_logits() -> None:
    model = _sharp_model()
    idx = torch.randint(0, 40, (2, 24))
    changed = idx.clone()
    changed[:, 15:] = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 15:], b[:, 15:], atol=1e-3)


@pytest.mark.parametrize("case", sorted(CACHED))
def test_the_table_changes_the_logits(case: str) -> None:
    """The bias is on, on every path: the same model with e at zero (its init) gives other logits."""
    model = _sharp_model(**CACHED[case])
    idx = torch.randint(0, 40, (2, 24))
    with torch.no_grad():
        with_e = model(idx)
        model.pos.pos_emb.zero_()
        assert not torch.allclose(model(idx), with_e, atol=1e-3)


def test_talking_heads_at_its_init_is_mha() -> None:
    """Talking heads' mixes start at the identity, so with MHA's weights it is MHA: CoPE reads each head's own query
    and logits (not the mixed query's layout)."""
    torch.manual_seed(0)
    cfg = resolve(GPTConfig(vocab_size=40, n_layer=2, d_model=32, n_head=4, max_seq_len=32, bias=True,
                            position={"name": "cope", "npos_max": 6}))
    pos = build("position", POSITIONS, cfg.position, 32, 8, 4, 32, 32, {"name": "none"})
    with torch.no_grad():
        pos.pos_emb.copy_(torch.randn_like(pos.pos_emb))
    mha = build("attention", ATTENTIONS, {"name": "mha"}, cfg)
    talking = build("attention", ATTENTIONS, {"name": "talking_heads"}, cfg)
    talking.load_state_dict(mha.state_dict(), strict=False)
    x = torch.randn(2, 12, 32) * 3
    with torch.no_grad():
        torch.testing.assert_close(talking(x, pos), mha(x, pos), **TOL)


@pytest.mark.parametrize("attention", [{"name": "mha", "doc_mask": True},
                                       {"name": "gqa", "doc_mask": True, "window": 4}])
def test_a_document_in_a_packed_block_reads_as_the_document_alone(attention: dict) -> None:
    """The gates of other documents' keys are dropped before the sum, so the count restarts at each document: the
    outputs on document B inside [A, EOD, B, EOD, C] are B's alone."""
    a, b, c = [5, 6, 7, 8, 9, E], [10, 11, 12, 13, 14, 15, 16, 17, 18, E], [19, 20, 21]
    kw = dict(eod_id=E, attention=attention, n_kv_head=2 if attention["name"] == "gqa" else None)
    model = _sharp_model(**kw)
    with torch.no_grad():
        inside = model(torch.tensor([a + b + c]))[:, len(a):len(a) + len(b)]
        alone = model(torch.tensor([b]))
        cache = KVCache(2)  # and token by token through the cache, across the documents
        packed = torch.tensor([a + b + c])
        steps = [model(packed[:, :3], cache=cache)] + [model(packed[:, t:t + 1], cache=cache)
                                                      for t in range(3, packed.size(1))]
        full = model(packed)
    torch.testing.assert_close(inside, alone, **TOL)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def test_a_composed_model_trains_forward_and_backward() -> None:
    cfg = compose(["position=cope", "model.vocab_size=50"])
    assert cfg.position.npos_max == 64
    model = build_model(cfg)
    assert torch.equal(model.pos.pos_emb, torch.zeros(model.cfg.attn_head_dim, 64))  # zeros, as the paper's
    idx = torch.randint(0, 50, (2, 16))
    loss = model(idx, idx)
    assert math.isfinite(loss.item())
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
    assert model.pos.pos_emb.grad.abs().sum() > 0


def test_what_cope_refuses() -> None:
    base = dict(vocab_size=50, n_layer=1, d_model=32, n_head=4, max_seq_len=16)
    with pytest.raises(ValueError, match=r"position='cope' does not take \['per_document'\]"):
        validate(GPTConfig(**base, position={"name": "cope", "per_document": True}))
    with pytest.raises(ValueError, match=r"rope_scaling='linear' needs position=rope.*position='cope'"):
        validate(resolve(GPTConfig(**base, position={"name": "cope"}, rope_scaling={"name": "linear", "factor": 2.0})))
    for axes in ({"norm": {"name": "layer"}}, {"norm": {"name": "rms"}, "ffn": {"name": "swiglu"}}):  # GPT-2, Llama
        cfg = resolve(GPTConfig(**base, position={"name": "cope"}, **axes))
        with pytest.raises(NotRepresentable, match=r"^position='cope'"):
            family(cfg)


def test_the_gates_and_positions_state_their_memory() -> None:
    """The (B, nh, T, T) gates, positions, gathered logits and bias (fp32, int64 indices) and SDPA's scores under the
    explicit mask are counted."""
    n_head, T, batch = 4, 64, 2
    entries = batch * n_head * T * T
    need = POSITIONS["cope"].attention_bytes(n_head, T, batch)
    assert need >= entries * (4 * 6 + 8 * 2) + entries * 8  # six fp32 tensors, two int64 indices; scores, softmax
