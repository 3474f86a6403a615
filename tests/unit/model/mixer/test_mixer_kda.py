"""Kimi Delta Attention (lmlab/model/mixer/kda.py): the chunked form against the Kimi delta rule written from the paper,
against transformers' own torch forms of it, HF parity of the layer (KimiLinearDeltaAttention: projections, short
conv, the per-channel forget gate, β, the sigmoid-gated output norm, out projection), causality, cached generation,
document resets, geometry, init, key checks, and a hybrid composed from YAML that trains."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention.cache import LayerCache
from lmlab.model.gpt import validate
from lmlab.model.mixer.gdn import l2norm
from lmlab.model.mixer.kda import KimiDeltaAttention, from_hf_state, hf_state, kimi_delta_rule
from lmlab.model.resolve import resolve

KEYS = dict(n_heads=2, head_dim=8, conv_size=4, chunk_size=5)  # 2 heads of 8: HF's layer has dk = dv = gate rank
BASE = dict(vocab_size=64, n_layer=2, d_model=32, n_head=4)


def config(doc_mask: bool = False, **extra) -> GPTConfig:
    attention = {"name": "mha", "doc_mask": True} if doc_mask else {"name": "mha"}
    return resolve(GPTConfig(**{**BASE, **extra}, eod_id=0 if doc_mask else None, attention=attention))


def layer(doc_mask: bool = False, **keys) -> KimiDeltaAttention:
    torch.manual_seed(0)
    m = KimiDeltaAttention(config(doc_mask), 0, **{**KEYS, **keys}).double()
    with torch.no_grad():  # away from the init so every term matters (varied decays, the norm's gain, the gates)
        m.A_log.copy_(torch.linspace(-2.0, 0.5, m.n_heads))
        m.dt_bias.copy_(torch.randn_like(m.dt_bias))
        m.norm_weight.add_(0.3 * torch.randn_like(m.norm_weight))
        for p in (m.f_a_proj.weight, m.f_b_proj.weight, m.g_a_proj.weight, m.g_b_proj.weight):
            p.mul_(3.0)
    return m


def recurrence(q, k, v, g, beta, state=None, starts=None):
    """The Kimi delta rule token by token, as Kimi Linear writes it (S: dk × dv per head, HF's orientation):
    S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t, α_t = exp(g_t) one per key channel;
    S emptied at a document start. Matrices written out, one (b, h) pair at a time: independent of the chunked form."""
    b, h, T, dk = k.shape
    eye = torch.eye(dk, dtype=q.dtype)
    S = torch.zeros(b, h, dk, v.size(-1), dtype=q.dtype) if state is None else state.clone()
    out = torch.zeros(b, h, T, v.size(-1), dtype=q.dtype)
    for i in range(b):
        for j in range(h):
            s = S[i, j]
            for t in range(T):
                if starts is not None and starts[i, t]:
                    s = torch.zeros_like(s)
                kt, vt, bt = k[i, j, t, :, None], v[i, j, t, :, None], beta[i, j, t]
                s = (eye - bt * kt @ kt.T) @ torch.diag(torch.exp(g[i, j, t])) @ s + bt * kt @ vt.T
                out[i, j, t] = s.T @ q[i, j, t]
            S[i, j] = s
    return out, S


def inputs(b=2, h=3, T=13, dk=4, dv=5, dtype=torch.float64):
    torch.manual_seed(1)
    q, k = (l2norm(torch.randn(b, h, T, dk, dtype=dtype)) for _ in range(2))
    v = torch.randn(b, h, T, dv, dtype=dtype)
    g = -torch.rand(b, h, T, dk, dtype=dtype) * 1.5  # a decay per channel: some near 1, some near e^-1.5
    beta = torch.rand(b, h, T, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 16])
def test_chunked_form_equals_the_recurrence(chunk):
    q, k, v, g, beta = inputs()
    S0 = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    starts = torch.zeros(2, 13, dtype=torch.bool)
    starts[0, 3], starts[0, 10], starts[1, 5] = True, True, True  # inside a chunk and on a boundary (chunk 5)
    for state, cut in ((None, None), (S0, None), (S0, starts)):
        o, S = kimi_delta_rule(q, k, v, g, beta, chunk, state, cut)
        o_ref, S_ref = recurrence(q, k, v, g, beta, state, cut)
        assert (o - o_ref).abs().max() < 1e-10 and (S - S_ref).abs().max() < 1e-10


def test_a_per_channel_decay_is_not_a_per_head_one():
    """With every channel's decay equal KDA is GDN's rule; with them unequal it differs (the decay is fine-grained)."""
    from lmlab.model.mixer.gdn import gated_delta_rule
    q, k, v, g, beta = inputs()
    flat = g[..., :1].expand_as(g)
    torch.testing.assert_close(kimi_delta_rule(q, k, v, flat, beta, 5)[0], gated_delta_rule(q, k, v, flat[..., 0],
                                                                                            beta, 5)[0])
    assert (kimi_delta_rule(q, k, v, g, beta, 5)[0] - kimi_delta_rule(q, k, v, flat, beta, 5)[0]).abs().max() > 1e-2


def test_the_rule_equals_transformers_torch_forms():
    kl = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    torch.manual_seed(2)
    B, T, H, dk, dv = 2, 11, 3, 8, 6
    q, k = torch.randn(2, B, T, H, dk)  # HF's layout (B, T, heads, size), float32 as its torch forms compute
    v, S0 = torch.randn(B, T, H, dv), torch.randn(B, H, dk, dv)
    g, beta = -torch.rand(B, T, H, dk) * 2, torch.rand(B, T, H)
    ours_q, ours_k = (l2norm(t).transpose(1, 2) for t in (q, k))
    o, S = kimi_delta_rule(ours_q / math.sqrt(dk), ours_k, v.transpose(1, 2), g.transpose(1, 2), beta.transpose(1, 2),
                           4, S0)
    for hf, kw in ((kl.chunk_kimi_delta_attention, {"chunk_size": 4}), (kl.recurrent_kimi_delta_attention, {})):
        o_hf, S_hf = hf(q, k, v, g=g, beta=beta, initial_state=S0, output_final_state=True,
                        use_qk_l2norm_in_kernel=True, **kw)
        torch.testing.assert_close(o.transpose(1, 2), o_hf, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(S, S_hf, rtol=1e-5, atol=1e-5)


def test_layer_equals_transformers_kimi_linear():
    """Every piece maps exactly: q/k/v_proj stacked into in_proj_qkv, conv1d, b_proj, forget_gate.{f_a_proj,
    f_b_proj, dt_bias, A_log (1, 1, H, 1) -> (H,)}, g_a_proj, g_b_proj, o_norm.weight, o_proj. HF's torch forms
    compute in float32 whatever the weights' dtype, so the layers agree to float32 rounding."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention
    hf_cfg = transformers.KimiLinearConfig(hidden_size=32, linear_num_heads=2, linear_head_dim=8,
                                           linear_conv_kernel_dim=4, rms_norm_eps=1e-6, num_hidden_layers=1,
                                           vocab_size=64, layer_types=["linear_attention"])
    torch.manual_seed(3)
    hf = KimiLinearDeltaAttention(hf_cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    ours = KimiDeltaAttention(config(), 0, **KEYS).eval()
    hf_sd = hf.state_dict()
    prefix = "model.layers.0.self_attn."
    ours.load_state_dict(from_hf_state({prefix + n: t for n, t in hf_sd.items()}, prefix))
    back = hf_state(ours.state_dict())  # the inverse: HF's tensors exactly
    assert back.keys() == hf_sd.keys() and all(torch.equal(back[n], hf_sd[n]) for n in hf_sd)
    x = torch.randn(2, 13, 32)
    with torch.no_grad():
        ours_y, hf_y = ours(x), hf(x)
        torch.testing.assert_close(ours_y, hf_y, rtol=1e-5, atol=1e-5)
        assert hf_y.abs().mean() > 0.1  # not a vanishing output agreeing trivially
        long = torch.randn(1, 150, 32)  # HF's chunks of 64 against ours of 5: a state carried over many chunks
        torch.testing.assert_close(ours(long), hf(long), rtol=1e-4, atol=1e-5)


def test_no_output_reads_a_later_token():
    m = layer()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 7] += torch.randn(2, 32, dtype=torch.float64)
    y, y2 = m(x), m(x2)
    assert (y[:, :7] - y2[:, :7]).abs().max() == 0 and (y[:, 7:] - y2[:, 7:]).abs().max() > 1e-3


def test_cached_generation_equals_the_full_forward_with_a_constant_state():
    m = layer()
    x = torch.randn(2, 17, 32, dtype=torch.float64)
    full, cache = m(x), LayerCache()
    steps, held = [m(x[:, :8], cache=cache)], []
    for t in range(8, 17):
        cache.offset = t
        steps.append(m(x[:, t:t + 1], cache=cache))
        held.append(cache.bytes)
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-10, atol=1e-10)
    assert set(cache.state) == {"conv", "ssm"} and cache.state["ssm"].shape == (2, 2, 8, 8)
    assert len(set(held)) == 1 and held[0] == 8 * (2 * 2 * 8 * 8 + 2 * 3 * 3 * 16)  # fp64: 8 bytes a number


def test_a_packed_document_reads_as_it_would_alone():
    masked, plain = layer(doc_mask=True), layer()
    a, b = torch.randn(1, 11, 32, dtype=torch.float64), torch.randn(1, 9, 32, dtype=torch.float64)
    packed, doc = torch.cat((a, b), 1), torch.tensor([[0] * 11 + [1] * 9])
    alone = masked(b)
    torch.testing.assert_close(masked(packed, doc=doc)[:, 11:], alone, rtol=1e-10, atol=1e-10)
    assert (plain(packed, doc=doc)[:, 11:] - alone).abs().max() > 1e-3  # without doc_mask A is read
    cache = LayerCache()  # a prompt with the start inside it, then a token at a time: the state is cut too
    steps = [masked(packed[:, :14], cache=cache, doc=doc[:, :14])]
    for t in range(14, 20):
        cache.offset = t
        steps.append(masked(packed[:, t:t + 1], cache=cache, doc=doc[:, :t + 1]))
    torch.testing.assert_close(torch.cat(steps, 1)[:, 11:], alone, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("keys", [KEYS, {}, dict(v_head_dim=4, gate_rank=3), dict(n_heads=2, head_dim=16)])
def test_geometry_counts_the_weights_and_the_state(keys):
    for bias in (False, True):
        cfg = resolve(GPTConfig(**BASE, bias=bias))
        m = KimiDeltaAttention(cfg, 0, **keys)
        geo = KimiDeltaAttention.geometry(cfg, **keys)
        assert geo.n_params == sum(p.numel() for p in m.parameters())
        m(torch.randn(1, 3, 32), cache=(cache := LayerCache()))
        assert geo.state_numbers == sum(t.numel() for t in cache.state.values())
        assert geo.flops_per_token > 0


def test_figures_and_init():
    m = KimiDeltaAttention(config(), 0, **KEYS)
    assert torch.all((m.A_log.exp() >= 1 - 1e-6) & (m.A_log.exp() <= 16 + 1e-5))
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert m.dt_bias.shape == (16,) and torch.all((dt >= 1e-4 - 1e-7) & (dt <= 0.1 + 1e-6))
    assert torch.all(KimiDeltaAttention(config(), 0, **KEYS, dt_init="constant").dt_bias == 1)
    m(torch.randn(2, 5, 32))
    f = m.figures()
    assert set(f) == {"state_norm", "gate_mean", "beta_mean"} and f["state_norm"] > 0
    assert 0 < f["gate_mean"] < 1 and 0 < f["beta_mean"] < 1
    assert m.backend_used == "torch"
    # no kernel path: auto takes the PyTorch form on a CUDA device too (where gdn's would take fla's)
    assert m.backend._choose(torch.device("cuda"), torch.bfloat16) == "torch"


@pytest.mark.parametrize("mixer,match", [
    ({"name": "kda", "n_heads": 3}, r"mixer\.n_heads=3 does not divide model\.d_model=32"),
    ({"name": "kda", "chunk_size": 0}, r"mixer\.chunk_size=0 must be an integer >= 1"),
    ({"name": "kda", "backend": "fla"}, r"mixer\.backend='fla'"),
    ({"name": "kda", "n_v_heads": 8}, r"mixer='kda' does not take \['n_v_heads'\]"),
])
def test_a_bad_key_is_refused_by_name(mixer, match):
    with pytest.raises(ValueError, match=match):
        validate(GPTConfig(**BASE, mixer=mixer))


def test_a_hybrid_composed_from_yaml_trains():
    from lmlab import build_model, compose
    cfg = compose(["mixer=kda", "mixer.pattern=[kda,attention]", "model.n_layer=2", "model.d_model=32",
                   "model.n_head=2"])
    assert cfg.mixer.name == "kda" and cfg.mixer.chunk_size == 16
    torch.manual_seed(4)
    model = build_model(cfg, vocab_size=64)
    assert isinstance(model.h[0].mix, KimiDeltaAttention) and hasattr(model.h[1], "attn")
    idx = torch.randint(0, 64, (4, 33))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(30):
        loss = model(idx[:, :-1], targets=idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < 0.5 * losses[0]
    assert all(p.grad is not None for p in model.h[0].mix.parameters())  # every KDA weight gets a gradient
