"""attention.forget_gate (Lin et al., 2025, "Forgetting Transformer", FoX): f_t = σ(w_h·x_t + b_h) per head and the
logits get D_ij = Σ_{l=j+1..i} log f_l. Against that sum written out token by token (fp64); standard attention when
log f = 0; the bias init kept through the init schemes; causality; cached generation (windows: the cache trims the
sums with the keys); a document in a packed block reads as alone; every attention path against the explicit one; the
refusals by key; a model composed from YAML trains; the optimizer roles."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab import build_model, compose
from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS
from lmlab.model.attention.cache import KVCache
from lmlab.model.attention.score import SCORES, attend, explicit_weights
from lmlab.model.gpt import GPT, validate
from lmlab.model.position import POSITIONS

B, T, C, NH = 2, 7, 16, 4
HS = C // NH
E = 3  # the end-of-document token of these tests
TOL = dict(rtol=1e-5, atol=1e-5)


def _model(attention: dict | None = None, **kw) -> GPT:
    base = dict(vocab_size=30, n_layer=2, d_model=C, n_head=NH, max_seq_len=32, position={"name": "none"},
                attention={"name": "mha", "forget_gate": True, **(attention or {})})
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(**{**base, **kw}))).eval()
    with torch.no_grad():  # sharp attention and gates that differ from token to token
        for name, p in model.named_parameters():
            if name.endswith(("attn.c_attn.weight", "attn.kv_b.weight", "attn.q_proj.weight")):
                p.mul_(10)
            elif name.endswith("attn.forget.weight"):
                p.normal_(0, 1.0)
    return model


def test_the_logits_get_the_sum_of_the_log_gates_since_each_key_by_hand() -> None:
    """softmax_j(q_i·k_j/√d + Σ_{l=j+1..i} log σ(w_h·x_l + b_h)) v_j, the sum over the gates of the tokens after key j
    up to query i, written out per query and key in fp64 from the layer's own weights."""
    model = _model(attention={"forget_bias": 1.5}, n_layer=1, bias=True).double()
    attn = model.h[0].attn
    x = torch.randn(B, T, C, dtype=torch.float64)
    W, b = attn.c_attn.weight, attn.c_attn.bias
    q, k, v = (F.linear(x, W[i * C:(i + 1) * C], b[i * C:(i + 1) * C]).view(B, T, NH, HS) for i in range(3))
    log_f = F.logsigmoid(x @ attn.forget.weight.T + attn.forget_bias)  # (B, T, nh)
    y = torch.zeros(B, T, NH, HS, dtype=torch.float64)
    for bb in range(B):
        for h in range(NH):
            for i in range(T):
                logits = torch.stack([q[bb, i, h] @ k[bb, j, h] / math.sqrt(HS) + log_f[bb, j + 1:i + 1, h].sum()
                                      for j in range(i + 1)])
                y[bb, i, h] = logits.softmax(0) @ v[bb, :i + 1, h]
    expected = attn.c_proj(y.reshape(B, T, C))
    with torch.no_grad():
        torch.testing.assert_close(attn(x, model.pos), expected, rtol=1e-10, atol=1e-10)
        weights, _ = attn.probs(x, model.pos)  # the monitor's explicit weights: the same decay
    assert attn.sums_to_one
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, NH, T, dtype=torch.float64))


def test_gates_of_one_are_standard_attention() -> None:
    """log f = 0 (a bias at +∞) leaves the logits unchanged: the layer is MHA with the same weights."""
    gated = _model(n_layer=1)
    plain = _model(n_layer=1, attention={"forget_gate": False})
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if ".forget" not in k})
    idx = torch.randint(0, 30, (B, 12))
    with torch.no_grad():
        gated.h[0].attn.forget_bias.fill_(float("inf"))  # a test hook: the key takes finite numbers only
        torch.testing.assert_close(gated(idx), plain(idx), rtol=0, atol=1e-6)
        gated.h[0].attn.forget_bias.fill_(0.0)
        assert not torch.allclose(gated(idx), plain(idx), atol=1e-3)


@pytest.mark.parametrize("init", ["gpt2", "xavier"])
def test_the_bias_init_survives_the_init_schemes_and_sets_a_decay_time(init: str) -> None:
    """b_h is its own parameter (the init schemes zero Linear biases): FoX's 0 by default, σ(0) = 1/2 per token; a
    decay time τ at init is b = −log(e^(1/τ) − 1), i.e. log f = −1/τ."""
    assert all(torch.equal(blk.attn.forget_bias, torch.zeros(NH)) for blk in _model(init={"name": init}).h)
    tau = 32.0
    b = -math.log(math.expm1(1 / tau))
    model = _model(init={"name": init}, attention={"forget_bias": b})
    assert all(torch.allclose(blk.attn.forget_bias, torch.full((NH,), b)) for blk in model.h)
    assert F.logsigmoid(torch.tensor(b, dtype=torch.float64)).item() == pytest.approx(-1 / tau)


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
    {"attention": {"window": 1}},  # a window of one keeps no key: the sums start again, only differences count
    {"attention": {"name": "mla"}, "position": {"name": "rope"}},
    {"attention": {"doc_mask": True, "window": 4}, "eod_id": E},
])
def test_cached_generation_gives_the_full_forward(case: dict) -> None:
    model = _model(**{**case, "attention": {"forget_gate": True, **case.get("attention", {})}})
    idx = torch.randint(0, 30, (B, 16), generator=torch.Generator().manual_seed(3))
    idx[0, [4, 9]] = E
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(2)
        steps = [model(idx[:, :5], cache=cache), model(idx[:, 5:8], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(8, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)
    layer = cache.layers[0]
    assert layer.forget.shape[-1] == layer.k.shape[-2]  # a sum per cached key, trimmed with them


@pytest.mark.parametrize("position", ["none", "rope", "alibi"])
def test_a_document_in_a_packed_block_reads_as_the_document_alone(position: str) -> None:
    """D_ij only sums the gates between key j and query i, all in their document: the cumulative sums need no reset
    at a document start."""
    a, b, c = [5, 6, 7, 8, 9, E], [10, 11, 12, 13, 14, 15, 16, E], [17, 18, 19]
    model = _model(attention={"doc_mask": True}, eod_id=E, position={"name": position})
    with torch.no_grad():
        inside = model(torch.tensor([a + b + c]))[:, len(a):len(a) + len(b)]
        alone = model(torch.tensor([b]))
    torch.testing.assert_close(inside, alone, **TOL)


def _pos(name: str, heads: int):
    return POSITIONS[name](16, 8, heads, 64, 64, {"name": "none"})


@pytest.mark.parametrize("T_, offset, S, window, docs, kv, position", [
    (9, 0, 9, None, False, 4, "none"),  # SDPA with a dense bias
    (9, 0, 9, 4, False, 2, "alibi"),  # the banded path, ALiBi's bias beside the decay
    (3, 6, 9, None, True, 4, "none"),  # a cached prefix, documents
    (5, 7, 6, 6, True, 1, "alibi"),  # a windowed cache holding the last keys only, one key head
    (1, 11, 12, None, False, 2, "none"),  # one token after a cache
])
def test_every_path_is_the_explicit_one(T_, offset, S, window, docs, kv, position) -> None:
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, T_, 8), torch.randn(2, kv, S, 8), torch.randn(2, kv, S, 8)
    c = F.logsigmoid(torch.randn(2, 4, offset + T_)).cumsum(-1)
    forget = (c[..., offset:], c[..., offset + T_ - S:])
    doc = None
    if docs:
        d = torch.tensor([[0] * 4 + [1] * 5 + [2] * 20, [0] * 8 + [1] * 21])[:, :offset + T_]
        doc = (d[:, offset:], d[:, offset + T_ - S:])
    pos, softmax = _pos(position, 4), SCORES["softmax"](64)
    got = attend(q, k, v, softmax, 0.4, pos, offset, window=window, doc=doc, forget=forget)
    kk, vv = (t.repeat_interleave(4 // kv, dim=1) for t in (k, v))
    w, _ = explicit_weights(q, kk, softmax, 0.4, pos, offset, window, doc=doc, forget=forget)
    torch.testing.assert_close(got, w @ vv, **TOL)
    sinked = attend(q, k, v, softmax, 0.4, pos, offset, window=window, doc=doc, forget=forget,
                    sink=torch.full((4,), -1e4))  # the explicit path itself
    torch.testing.assert_close(sinked, got, **TOL)


@pytest.mark.parametrize("keys, message", [
    ({"name": "diff"}, r"attention=diff .* attention\.forget_gate=true does not apply"),
    ({"name": "talking_heads"}, r"attention=talking_heads .* attention\.forget_gate=true does not apply"),
    ({"score": "relu2"}, r"attention\.forget_gate=true needs attention\.score=softmax\|softmax_plus"),
    ({"forget_gate": False, "forget_bias": 2.0}, r"attention\.forget_bias=2\.0 needs attention\.forget_gate=true"),
])
def test_where_it_does_not_apply_it_is_refused_by_key(keys: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _model(attention=keys)


def test_block_gau_refuses_it_by_key() -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=r"attention\.forget_gate=True: block=gau has no attention sublayer"):
        check_config(compose(["block=gau", "attention.forget_gate=true"]))


def test_a_model_composed_from_yaml_trains_and_its_weights_are_counted() -> None:
    from lmlab.model.resolve import n_params_estimate
    from lmlab.optim import param_groups

    cfg = compose(["attention.forget_gate=true", "attention.forget_bias=2.0", "model.n_layer=2", "model.d_model=32",
                   "model.n_head=4", "model.max_seq_len=16"])
    model = build_model(cfg, vocab_size=50)
    attn = model.h[0].attn
    assert torch.allclose(attn.forget_bias, torch.full((4,), 2.0))
    idx = torch.randint(0, 50, (2, 16))
    loss = F.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    assert attn.forget.weight.grad.abs().sum() > 0 and attn.forget_bias.grad.abs().sum() > 0
    plain = build_model(compose(["model.n_layer=2", "model.d_model=32", "model.n_head=4", "model.max_seq_len=16"]),
                        vocab_size=50)
    added = model.num_params() - plain.num_params()
    assert added == 2 * (32 + 1) * 4 and n_params_estimate(model.cfg) - n_params_estimate(plain.cfg) == added
    geometry = ATTENTIONS["mha"].geometry(model.cfg, **model.cfg.attention)
    assert geometry.n_params == sum(p.numel() for p in attn.parameters())
    assert geometry.cache_width == ATTENTIONS["mha"].geometry(model.cfg).cache_width + 4  # c_j per head
    roles = {id(p): g["role"] for g in param_groups(model, 0.1, by_role=True) for p in g["params"]}
    assert roles[id(attn.forget.weight)] == "hidden"  # a Linear: Muon's under optim=muon
    assert roles[id(attn.forget_bias)] == "rest"  # a bias: AdamW, no decay


def test_the_training_forward_compiles_to_one_graph_with_the_gate_and_memory() -> None:
    from tests.unit.model.test_compile import _breaks

    attention = {"name": "gqa", "forget_gate": True, "mem_kv": 2, "window": 4}
    assert _breaks(attention=attention, position={"name": "rope"}) == (1, 0, [])
