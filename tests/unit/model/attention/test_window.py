"""Sliding-window attention, layer patterns and the attention-logit softcap: each mask against one built by hand token
by token, the O(T·W) banded path against the dense softmax it replaces, what a window means for the model (a token
past the window has no effect), the KV cache it keeps, their FLOPs, and their refusals by key."""

from __future__ import annotations

import random

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.mask import allowed, banded_sdpa, key_counts, layer_window
from lmlab.model.attention.score import SCORES, attend, explicit_weights
from lmlab.model.flops import flops_per_token
from lmlab.model.gpt import GPT, validate
from lmlab.model.position import POSITIONS

TOL = dict(rtol=1e-5, atol=1e-5)


def _nope(heads: int = 2):
    return POSITIONS["none"](16, 8, heads, 64, 64, {"name": "none"})


def _alibi(heads: int = 2):
    return POSITIONS["alibi"](16, 8, heads, 64, 64, {"name": "none"})


def test_the_window_mask_is_the_one_built_token_by_token() -> None:
    """Query at position p reads key at position q iff q <= p and p - q < W, for keys that end with the last query
    (a cache that dropped the oldest keys); documents of random sizes and offsets."""
    rng = random.Random(0)
    for _ in range(200):
        T, offset = rng.randint(1, 12), rng.randint(0, 12)
        S = rng.randint(T, offset + T)
        window = rng.choice([None, *range(1, 15)])
        mask = allowed(T, offset, S, window, torch.device("cpu"))
        first = offset + T - S
        for i in range(T):
            for j in range(S):
                p, q = offset + i, first + j
                assert bool(mask[i, j]) == (q <= p and (window is None or p - q < window)), (T, offset, S, window)
        n = key_counts(T, offset, torch.device("cpu"), window)
        assert n.tolist() == [float(min(offset + i + 1, window or 10**9)) for i in range(T)]


def _dense_softmax(q, k, v, scale, mask, bias=None):
    """softmax(q kᵀ · scale + bias, masked) v written out, key heads repeated to the query heads."""
    k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
    v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
    logits = (q @ k.transpose(-2, -1)) * scale
    if bias is not None:
        logits = logits + bias.masked_fill(~mask, 0.0)
    return logits.masked_fill(~mask, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("window,T,offset,S", [(1, 9, 0, 9), (3, 9, 0, 9), (4, 16, 0, 16), (8, 7, 0, 7),
                                               (3, 5, 6, 7), (4, 1, 20, 4), (5, 6, 2, 8)])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_the_banded_path_is_the_dense_windowed_softmax(window, T, offset, S, heads) -> None:
    torch.manual_seed(0)
    h, hkv = heads
    q, k, v = torch.randn(2, h, T, 8), torch.randn(2, hkv, S, 8), torch.randn(2, hkv, S, 8)
    mask = allowed(T, offset, S, window, q.device)
    expected = _dense_softmax(q, k, v, 0.3, mask)
    torch.testing.assert_close(banded_sdpa(q, k, v, scale=0.3, window=window, offset=offset), expected, **TOL)
    torch.testing.assert_close(attend(q, k, v, SCORES["softmax"](64), 0.3, _nope(h), offset, window=window),
                               expected, **TOL)
    for block in (1, 2, 5):  # the blocks are an implementation detail
        out = banded_sdpa(q, k, v, scale=0.3, window=window, offset=offset, block=block)
        torch.testing.assert_close(out, expected, **TOL)


def test_the_banded_path_adds_a_position_bias_inside_the_window() -> None:
    torch.manual_seed(1)
    T, window, pos = 10, 3, _alibi(2)
    q, k, v = (torch.randn(1, 2, T, 8) for _ in range(3))
    bias = pos.attn_bias(T, q.device, q.dtype, 0)
    expected = _dense_softmax(q, k, v, 0.5, allowed(T, 0, T, window, q.device), bias)
    torch.testing.assert_close(attend(q, k, v, SCORES["softmax"](64), 0.5, pos, 0, window=window), expected, **TOL)


def test_relu2_under_a_window_divides_by_the_keys_it_reads() -> None:
    """relu²(logits)/n with n = min(W, i + 1): the keys the query reads, not its position."""
    torch.manual_seed(2)
    T, window = 6, 2
    q, k, v = (torch.randn(1, 1, T, 4) for _ in range(3))
    logits = q @ k.transpose(-2, -1)
    out = attend(q, k, v, SCORES["relu2"](64), 1.0, _nope(1), 0, window=window)
    for i in range(T):
        reads = [j for j in range(T) if j <= i and i - j < window]
        row = sum(torch.relu(logits[0, 0, i, j]) ** 2 * v[0, 0, j] for j in reads) / len(reads)
        torch.testing.assert_close(out[0, 0, i], row, **TOL)


def test_the_softcap_bounds_the_logits_by_its_formula() -> None:
    """Gemma 2's softcap: logits -> c·tanh(logits / c) before the softmax; every logit within (-c, c)."""
    torch.manual_seed(3)
    q, k = torch.randn(1, 2, 5, 8) * 1.5, torch.randn(1, 2, 5, 8) * 1.5
    c = 2.5
    weights, logits = explicit_weights(q, k, SCORES["softmax"](64), 1.0, _nope(), softcap=c)
    raw = q @ k.transpose(-2, -1)
    mask = allowed(5, 0, 5, None, q.device)
    expected = (c * torch.tanh(raw / c)).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(logits, expected, **TOL)
    torch.testing.assert_close(weights, expected.softmax(-1), **TOL)
    assert logits[mask.expand_as(logits)].abs().max() < c < raw[mask.expand_as(raw)].abs().max()


def _model(**kw) -> GPT:
    base = dict(vocab_size=30, n_layer=1, d_model=32, n_head=4, max_seq_len=24, position={"name": "rope"})
    torch.manual_seed(0)
    return GPT(validate(GPTConfig(**{**base, **kw}))).eval()


def test_a_token_past_the_window_has_no_effect_and_every_option_stays_causal() -> None:
    """One layer with a window of 5: changing token 0 changes the outputs at positions 0..4 and none after; changing
    token t never changes an output before t."""
    idx = torch.randint(0, 30, (1, 16), generator=torch.Generator().manual_seed(0))
    for attention in ({"name": "mha", "window": 5}, {"name": "gqa", "window": 5, "softcap": 3.0},
                      {"name": "mha", "window": 5, "score": "relu2"}):
        model = _model(attention=attention, n_kv_head=2 if attention["name"] == "gqa" else None)
        changed = idx.clone()
        changed[0, 0] = (idx[0, 0] + 1) % 30
        with torch.no_grad():
            diff = (model(idx) - model(changed)).abs().amax(-1)[0]
        assert (diff[:5] > 1e-6).all() and (diff[5:] == 0).all(), (attention, diff)
        for t in (3, 9, 15):
            later = idx.clone()
            later[0, t] = (idx[0, t] + 1) % 30
            with torch.no_grad():
                assert torch.equal(model(idx)[:, :t], model(later)[:, :t]), (attention, t)


def test_a_pattern_gives_each_layer_its_window() -> None:
    assert [layer_window(4, ["local", "local", "global"], i, 6, 24) for i in range(6)] == [4, 4, None, 4, 4, None]
    assert [layer_window(None, [2, "global"], i, 4, 24) for i in range(4)] == [2, None, 2, None]
    model = _model(n_layer=4, attention={"name": "mha", "window": 3, "pattern": ["local", "global"]})
    assert [b.attn.window for b in model.h] == [3, None, 3, None]


def test_the_kv_cache_of_a_local_layer_keeps_its_window() -> None:
    model = _model(n_layer=2, attention={"name": "mha", "window": 4, "pattern": ["local", "global"]})
    cache = KVCache(2)
    idx = torch.randint(0, 30, (1, 12))
    with torch.no_grad():
        model(idx[:, :7], cache=cache)
        for t in range(7, 12):
            model(idx[:, t:t + 1], cache=cache)
    assert cache.layers[0].k.size(-2) == 3 and cache.layers[1].k.size(-2) == 12  # W - 1 keys; all of them


def test_a_window_costs_its_keys_in_the_flop_count() -> None:
    full, local = _model(n_layer=2), _model(n_layer=2, attention={"name": "mha", "window": 4, "pattern": ["local",
                                                                                                        "global"]})
    f_full, f_local = flops_per_token(full, 24)["train"], flops_per_token(local, 24)["train"]
    attn_width = full.cfg.attn_width
    assert f_full - f_local == 6 * (24 - 4) * attn_width  # one layer reads 4 keys instead of 24


@pytest.mark.parametrize("overrides,message", [
    (["attention.window=200"], "attention.window=200 is larger than the context (model.max_seq_len=128)"),
    (["attention.window=0"], "attention.window=0 must be a window of >= 1 keys"),
    (["attention.pattern=[local,global,global]"], "has 3 entries, which must divide model.n_layer=4"),
    (["attention.pattern=[local,global]"], "has local layers but attention.window is null"),
    (["attention.pattern=[wide,global]"], "entry 'wide' is not local, global or a window size"),
    (["attention.softcap=0"], "attention.softcap=0 must be"),
])
def test_bad_windows_are_refused_by_key(overrides, message) -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=None) as err:
        check_config(compose(overrides))
    assert message in str(err.value), str(err.value)


def test_a_llama_like_window_exports_as_ministral_and_a_gpt2_like_one_is_refused() -> None:
    """The logits' parity both ways is tests/unit/interop/test_interop_hf.py's (ministral_window, ministral_pattern)."""
    from lmlab.interop.hf import NotRepresentable, family

    llama_like = _model(norm={"name": "rms"}, ffn={"name": "swiglu"}, attention={"name": "mha", "window": 4})
    assert family(llama_like.cfg) == "ministral"
    gpt2_like = _model(norm={"name": "layer"}, position={"name": "learned"}, attention={"name": "mha", "window": 4})
    with pytest.raises(NotRepresentable, match="^attention.window=4 has no GPT-2 form"):
        family(gpt2_like.cfg)


@pytest.mark.parametrize("gate,channels", [("elementwise", 0), ("headwise", 0), ("headwise", 12)])
def test_the_output_gate_is_its_formula_and_counted(gate, channels) -> None:
    """y ← y ⊙ σ(x W_g) before the output projection: per head dimension, or one per head broadcast over it; with
    gate_channels k from x's first k channels only (the speedrun's sparse gate, record 28); its weights are in the
    size estimate."""
    from lmlab.model.resolve import n_params_estimate

    model = _model(attention={"name": "mha", "gate": gate, "gate_channels": channels}, n_layer=2)
    plain = _model(n_layer=2)
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if ".gate." not in k})
    attn, ref = model.h[0].attn, plain.h[0].attn
    x = torch.randn(2, 9, 32)
    B, T = 2, 9
    with torch.no_grad():
        k_in = channels or 32
        g = torch.sigmoid(x[..., :k_in] @ attn.gate.weight.T)  # (B, T, nh·hs) or (B, T, nh)
        q, k, v = ref.qkv(x, model.pos)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=ref.scale)
        y = y * g.view(B, T, 4, -1).transpose(1, 2)
        expected = ref.c_proj(y.transpose(1, 2).reshape(B, T, 32))
        torch.testing.assert_close(attn(x, model.pos), expected, **TOL)
    width = {"elementwise": 32, "headwise": 4}[gate]
    assert model.num_params() - plain.num_params() == 2 * k_in * width  # two layers, no biases
    assert abs(n_params_estimate(model.cfg) - model.num_params()) / model.num_params() < 0.01


def test_a_sink_is_a_softmax_column_that_weighs_no_value() -> None:
    """gpt-oss's learned sinks: weights = exp(l_j) / (exp(s_h) + Σ_j exp(l_j)), so each row sums to 1 − the sink's
    share; a very negative sink is plain softmax, a very positive one attends to (almost) nothing."""
    torch.manual_seed(7)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    sink = torch.tensor([0.5, -1.0])
    mask = allowed(6, 0, 6, None, q.device)
    logits = (q @ k.transpose(-2, -1)).masked_fill(~mask, float("-inf"))
    z = logits.exp().sum(-1, keepdim=True) + sink.exp()[:, None, None]
    expected = logits.exp() / z
    out = attend(q, k, v, SCORES["softmax"](64), 1.0, _nope(), 0, sink=sink)
    torch.testing.assert_close(out, expected @ v, **TOL)
    plain = attend(q, k, v, SCORES["softmax"](64), 1.0, _nope(), 0)
    torch.testing.assert_close(attend(q, k, v, SCORES["softmax"](64), 1.0, _nope(), 0, sink=torch.full((2,), -1e4)),
                               plain, **TOL)
    assert attend(q, k, v, SCORES["softmax"](64), 1.0, _nope(), 0, sink=torch.full((2,), 1e4)).abs().max() < 1e-6


def test_the_monitor_logs_the_sinks_share_and_an_entropy_with_it() -> None:
    from types import SimpleNamespace

    from lmlab.run.monitor import StabilityMonitor

    model = _model(n_layer=2, attention={"name": "mha", "sinks": True})
    with torch.no_grad():
        model.h[0].attn.sink.fill_(2.0)  # layer 0's heads give the sink most of their weight
    monitor = StabilityMonitor()
    monitor._attn_in = {i: (torch.randn(2, 6, 32), None) for i in range(2)}
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=1)
    out = monitor._attention_stats(trainer, SimpleNamespace(model=model))
    assert out["attn/sink_mass/layer_00"] > out["attn/sink_mass/layer_01"] > 0
    assert 0 < out["attn/entropy/layer_00"] < torch.log(torch.tensor(7.0))  # 6 keys and the sink at most


def test_sinks_need_a_softmax() -> None:
    with pytest.raises(ValueError, match="attention.sinks=true needs attention.score=softmax"):
        _model(attention={"name": "mha", "sinks": True, "score": "relu2"})


def test_a_nope_layer_among_rope_layers_is_unrotated() -> None:
    """position.nope_layers (iRoPE): the listed layers read no positions; a one-layer model whose layer is one is the
    NoPE model with the same weights, and a layer outside the model is refused by key."""
    nope_layer = _model(position={"name": "rope", "nope_layers": [0]})
    plain = _model(position={"name": "none"})
    plain.load_state_dict(nope_layer.state_dict())
    idx = torch.randint(0, 30, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(nope_layer(idx), plain(idx), **TOL)
        assert not torch.allclose(_model()(idx), plain(idx), **TOL)  # the rotary model differs
    with pytest.raises(ValueError, match=r"position.nope_layers has \[4\], not layers of the model"):
        _model(n_layer=4, position={"name": "rope", "nope_layers": [3, 4]})


def test_differential_attention_is_the_papers_equations() -> None:
    """Ye et al. (2024), written out: per differential head j (query/key heads 2j, 2j + 1),
    (softmax(Q1 K1ᵀ/√d) − λ softmax(Q2 K2ᵀ/√d)) [V_2j; V_2j+1], RMSNorm over its 2d, × (1 − λ_init), with
    λ = exp(λq1·λk1) − exp(λq2·λk2) + λ_init and λ_init = 0.8 − 0.6·exp(−0.3 (l − 1))."""
    import math

    model = _model(n_layer=3, position={"name": "none"}, attention={"name": "diff"})
    attn, B, T, d, nh = model.h[2].attn, 2, 7, 8, 4
    assert attn.lambda_init == pytest.approx(0.8 - 0.6 * math.exp(-0.3 * 2))
    x = torch.randn(B, T, 32)
    with torch.no_grad():
        q, k, v = attn.c_attn(x).split(attn.c_attn.fused, dim=-1)
        q, k, v = (t.view(B, T, nh, d).transpose(1, 2) for t in (q, k, v))
        lam = (torch.exp(attn.lambda_q1 @ attn.lambda_k1) - torch.exp(attn.lambda_q2 @ attn.lambda_k2)
               + attn.lambda_init)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        heads = []
        for j in range(nh // 2):
            def softmax(qh, kh):
                return ((qh @ kh.transpose(-2, -1)) / math.sqrt(d)).masked_fill(~causal, float("-inf")).softmax(-1)
            a = softmax(q[:, 2 * j], k[:, 2 * j]) - lam * softmax(q[:, 2 * j + 1], k[:, 2 * j + 1])
            o = a @ torch.cat((v[:, 2 * j], v[:, 2 * j + 1]), dim=-1)  # (B, T, 2d)
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * attn.subln
            heads.append(o * (1 - attn.lambda_init))
        expected = attn.c_proj(torch.cat(heads, dim=-1))
        torch.testing.assert_close(attn(x, model.pos), expected, **TOL)
        weights, _ = attn.probs(x, model.pos)
        assert weights.shape == (B, 2, T, T)
        torch.testing.assert_close(weights.sum(-1), (1 - lam).expand(B, 2, T), **TOL)  # rows sum to 1 − λ


def test_attention_differential_is_the_name_spec_lists_for_diff() -> None:
    """`attention=differential` (SPEC's name) composes to attention=diff itself: the same keys, the same model."""
    a, b = compose(["attention=differential"]), compose(["attention=diff"])
    assert a.attention == b.attention and a.attention.name == "diff"


@pytest.mark.parametrize("kw,message", [
    ({"n_head": 3, "d_model": 48}, "model.n_head=3 must be even"),
    ({"attention": {"name": "diff", "score": "relu2"}}, "attention=diff is a difference of two softmax maps"),
    ({"position": {"name": "alibi"}}, "attention=diff with position=alibi"),
])
def test_differential_attention_refuses_what_it_cannot_pair(kw, message) -> None:
    with pytest.raises(ValueError, match=message):
        _model(**{"attention": {"name": "diff"}, **kw})


def test_the_monitor_logs_the_weight_on_the_first_token() -> None:
    """attn/first_token_mass: the mean weight the queries after the first put on the first token (the implicit sink
    learned sinks replace), from the same maps the entropy is computed on."""
    from types import SimpleNamespace

    from lmlab.run.monitor import StabilityMonitor

    model = _model(n_layer=2)
    x = torch.randn(2, 6, 32)
    monitor = StabilityMonitor()
    monitor._attn_in = {i: (x, None) for i in range(2)}
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=1)
    out = monitor._attention_stats(trainer, SimpleNamespace(model=model))
    with torch.no_grad():
        p, _ = model.h[1].attn.probs(x, model.pos)
    assert out["attn/first_token_mass/layer_01"] == pytest.approx(float(p[..., 1:, 0].mean()), rel=1e-5)
    assert 0 < out["attn/first_token_mass/layer_00"] < 1
