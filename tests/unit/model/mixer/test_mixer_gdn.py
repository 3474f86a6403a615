"""Gated DeltaNet (lmlab/model/mixer/gdn.py): the chunked form against the gated delta rule written from the paper,
against transformers' own kernels, HF parity of the layer (Qwen3NextGatedDeltaNet), causality, cached generation,
document resets, geometry and key checks."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention.cache import LayerCache
from lmlab.model.gpt import validate
from lmlab.model.mixer.gdn import GatedDeltaNet, from_hf_state, gated_delta_rule, hf_state, l2norm
from lmlab.model.resolve import resolve

KEYS = dict(n_heads=2, n_v_heads=4, head_dim=8, v_head_dim=6, conv_size=4, chunk_size=5)  # 2 key heads, 4 value
BASE = dict(vocab_size=64, n_layer=2, d_model=32, n_head=4)


def config(doc_mask: bool = False) -> GPTConfig:
    attention = {"name": "mha", "doc_mask": True} if doc_mask else {"name": "mha"}
    return resolve(GPTConfig(**BASE, eod_id=0 if doc_mask else None, attention=attention))


def layer(doc_mask: bool = False, **keys) -> GatedDeltaNet:
    torch.manual_seed(0)
    m = GatedDeltaNet(config(doc_mask), 0, **{**KEYS, **keys}).double()
    with torch.no_grad():  # away from the init so every term matters (slower decays, the norm's gain)
        m.A_log.copy_(torch.linspace(-2.0, 0.5, m.n_v_heads))
        m.norm_weight.add_(0.3 * torch.randn_like(m.norm_weight))
    return m


def recurrence(q, k, v, g, beta, state=None, starts=None):
    """The paper's gated delta rule token by token (its orientation, S: dv × dk):
    S_t = S_{t-1} · α_t (I - β_t k_t k_tᵀ) + β_t v_t k_tᵀ, o_t = S_t q_t, α_t = exp(g_t); S emptied at a start."""
    b, h, T, dk = k.shape
    eye = torch.eye(dk, dtype=q.dtype)
    S = torch.zeros(b, h, v.size(-1), dk, dtype=q.dtype) if state is None else state.transpose(-1, -2).clone()
    out = []
    for t in range(T):
        if starts is not None:
            S = S * (~starts[:, t]).to(q.dtype)[:, None, None, None]
        kt, bt = k[:, :, t], beta[:, :, t, None, None]
        alpha = torch.exp(g[:, :, t])[..., None, None]
        S = S @ (alpha * (eye - bt * kt[..., :, None] * kt[..., None, :])) + bt * v[:, :, t, :, None] * kt[..., None, :]
        out.append((S @ q[:, :, t, :, None])[..., 0])
    return torch.stack(out, 2), S.transpose(-1, -2)


def inputs(b=2, h=3, T=13, dk=4, dv=5, dtype=torch.float64):
    torch.manual_seed(1)
    q, k = (l2norm(torch.randn(b, h, T, dk, dtype=dtype)) for _ in range(2))
    v = torch.randn(b, h, T, dv, dtype=dtype)
    g = -torch.rand(b, h, T, dtype=dtype) * 0.7
    beta = torch.rand(b, h, T, dtype=dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize("chunk", [4, 5, 13, 16])
def test_chunked_form_equals_the_recurrence(chunk):
    q, k, v, g, beta = inputs()
    S0 = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    starts = torch.zeros(2, 13, dtype=torch.bool)
    starts[0, 3], starts[0, 10], starts[1, 5] = True, True, True  # inside a chunk and on a boundary (chunk 5)
    for state, cut in ((None, None), (S0, None), (S0, starts)):
        o, S = gated_delta_rule(q, k, v, g, beta, chunk, state, cut)
        o_ref, S_ref = recurrence(q, k, v, g, beta, state, cut)
        assert (o - o_ref).abs().max() < 1e-10 and (S - S_ref).abs().max() < 1e-10


def test_the_kernel_equals_transformers_kernels():
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    torch.manual_seed(2)
    B, T, Hk, Hv, dk, dv = 2, 11, 2, 4, 8, 6
    q, k = torch.randn(2, B, T, Hk, dk)  # HF's layout (B, T, heads, size), float32 as its kernels compute
    v, S0 = torch.randn(B, T, Hv, dv), torch.randn(B, Hv, dk, dv)
    g, beta = -torch.rand(B, T, Hv) * 2, torch.rand(B, T, Hv)
    ours_q, ours_k = (l2norm(t).repeat_interleave(Hv // Hk, dim=2).transpose(1, 2) for t in (q, k))
    o, S = gated_delta_rule(ours_q / math.sqrt(dk), ours_k, v.transpose(1, 2), g.transpose(1, 2),
                            beta.transpose(1, 2), 4, S0)
    for hf, kw in ((qn.torch_chunk_gated_delta_rule, {"chunk_size": 4}), (qn.torch_recurrent_gated_delta_rule, {})):
        o_hf, S_hf = hf(q, k, v, g, beta, initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True,
                        **kw)
        torch.testing.assert_close(o.transpose(1, 2), o_hf, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(S, S_hf, rtol=1e-5, atol=1e-5)


def test_layer_equals_transformers_qwen3_next():
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    hf_cfg = transformers.Qwen3NextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                          linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                          rms_norm_eps=1e-6, num_hidden_layers=1, vocab_size=64,
                                          layer_types=["linear_attention"])
    torch.manual_seed(3)
    hf = Qwen3NextGatedDeltaNet(hf_cfg, 0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    ours = GatedDeltaNet(config(), 0, **KEYS).eval()
    hf_sd = hf.state_dict()
    ours.load_state_dict(from_hf_state({"layers.0.linear_attn." + n: t for n, t in hf_sd.items()},
                                       "layers.0.linear_attn.", n_heads=2))
    back = hf_state(ours.state_dict(), n_heads=2)  # the inverse: HF's tensors exactly
    assert back.keys() == hf_sd.keys() and all(torch.equal(back[n], hf_sd[n]) for n in hf_sd)
    x = torch.randn(2, 13, 32)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), hf(x), rtol=1e-5, atol=1e-5)


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
    assert set(cache.state) == {"conv", "ssm"} and cache.state["ssm"].shape == (2, 4, 8, 6)
    assert len(set(held)) == 1 and held[0] == 8 * (2 * 4 * 8 * 6 + 2 * 3 * (2 * 16 + 24))  # fp64: 8 bytes a number


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


@pytest.mark.parametrize("keys", [KEYS, {}, dict(n_v_heads=8, v_head_dim=4), dict(n_heads=2, head_dim=16)])
def test_geometry_counts_the_weights_and_the_state(keys):
    for bias in (False, True):
        cfg = resolve(GPTConfig(**BASE, bias=bias))
        m = GatedDeltaNet(cfg, 0, **keys)
        geo = GatedDeltaNet.geometry(cfg, **keys)
        assert geo.n_params == sum(p.numel() for p in m.parameters())
        m(torch.randn(1, 3, 32), cache=(cache := LayerCache()))
        assert geo.state_numbers == sum(t.numel() for t in cache.state.values())
        assert geo.flops_per_token > 0


def test_figures_and_init():
    m = GatedDeltaNet(config(), 0, **KEYS)
    assert torch.all((m.A_log.exp() >= 0.01 - 1e-6) & (m.A_log.exp() <= 16 + 1e-5)) and torch.all(m.dt_bias == 1)
    m(torch.randn(2, 5, 32))
    f = m.figures()
    assert set(f) == {"state_norm", "gate_mean", "beta_mean"} and f["state_norm"] > 0
    assert 0 < f["gate_mean"] < 1 and 0 < f["beta_mean"] < 1


@pytest.mark.parametrize("mixer,match", [
    ({"name": "gdn", "n_heads": 4, "n_v_heads": 6}, r"mixer\.n_v_heads=6 is not a multiple of mixer\.n_heads=4.*"
                                                    r"\[4, 8, 12, 16\]"),
    ({"name": "gdn", "n_heads": 3}, r"mixer\.n_heads=3 does not divide model\.d_model=32"),
    ({"name": "gdn", "chunk_size": 0}, r"mixer\.chunk_size=0 must be an integer >= 1"),
])
def test_a_bad_key_is_refused_by_name(mixer, match):
    with pytest.raises(ValueError, match=match):
        validate(GPTConfig(**BASE, mixer=mixer))
