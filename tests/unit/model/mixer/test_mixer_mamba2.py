"""Mamba-2 (lmlab/model/mixer/mamba2.py): the chunked SSD scan against the recurrence written from the paper, HF
parity of the layer, causality, cached generation, document resets, geometry and key checks."""

from __future__ import annotations

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention.cache import LayerCache
from lmlab.model.mixer.mamba2 import Mamba2, from_hf_state, hf_state, ssd
from lmlab.model.resolve import resolve

KEYS = dict(d_state=8, expand=2, head_dim=8, n_groups=2, conv_size=4, chunk_size=5)  # 8 heads, 2 groups


def config(doc_mask: bool = False) -> GPTConfig:
    attention = {"name": "mha", "doc_mask": True} if doc_mask else {"name": "mha"}
    return resolve(GPTConfig(vocab_size=64, n_layer=2, d_model=32, n_head=4, eod_id=0 if doc_mask else None,
                             attention=attention))


def layer(doc_mask: bool = False, **keys) -> Mamba2:
    torch.manual_seed(0)
    m = Mamba2(config(doc_mask), 0, **{**KEYS, **keys}).double()
    with torch.no_grad():  # away from the init so every term matters (D, the norm's gain, the conv's bias)
        for p in (m.D, m.norm_weight, m.conv.conv.bias, m.dt_bias):
            p.add_(0.3 * torch.randn_like(p))
    return m


def recurrence(x, dt, A, B, C, state=None, starts=None):
    """The paper's recurrence token by token: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_tᵀ, y_t = h_t C_t."""
    b, T, h, p = x.shape
    S = torch.zeros(b, h, p, B.size(-1), dtype=x.dtype) if state is None else state.clone()
    ys = []
    for t in range(T):
        if starts is not None:
            S = S * (~starts[:, t]).to(x.dtype)[:, None, None, None]
        S = torch.exp(dt[:, t] * A)[..., None, None] * S + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None]
        ys.append((S @ C[:, t, :, :, None])[..., 0])
    return torch.stack(ys, 1), S


@pytest.mark.parametrize("chunk", [4, 5, 13, 16])
def test_chunked_scan_equals_the_recurrence(chunk):
    torch.manual_seed(1)
    b, T, h, p, N = 2, 13, 3, 4, 5
    x, B, C = torch.randn(b, T, h, p, dtype=torch.float64), *torch.randn(2, b, T, h, N, dtype=torch.float64)
    dt = torch.rand(b, T, h, dtype=torch.float64) + 0.1
    A = -torch.rand(h, dtype=torch.float64) - 0.2
    S0 = torch.randn(b, h, p, N, dtype=torch.float64)
    starts = torch.zeros(b, T, dtype=torch.bool)
    starts[0, 3], starts[0, 9], starts[1, 5] = True, True, True  # a start inside a chunk and on a boundary (chunk 5)
    for state, cut in ((None, None), (S0, None), (S0, starts)):
        y, S = ssd(x, dt, A, B, C, chunk, state, cut)
        y_ref, S_ref = recurrence(x, dt, A, B, C, state, cut)
        assert (y - y_ref).abs().max() < 1e-10 and (S - S_ref).abs().max() < 1e-10


@pytest.mark.parametrize("kind", ["mamba2", "nemotron_h"])
def test_layer_equals_hf(kind):
    transformers = pytest.importorskip("transformers")
    if kind == "mamba2":
        from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer
        hf_cfg = transformers.Mamba2Config(hidden_size=32, num_heads=8, head_dim=8, expand=2, state_size=8,
                                           n_groups=2, chunk_size=4, num_hidden_layers=1, vocab_size=64)
        hf, keys = Mamba2Mixer(hf_cfg, 0), {}
    else:
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer
        hf_cfg = transformers.NemotronHConfig(hidden_size=32, mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=8,
                                              n_groups=2, chunk_size=4, num_hidden_layers=1, vocab_size=64,
                                              layers_block_type=["mamba"])
        hf, keys = NemotronHMamba2Mixer(hf_cfg, 0), {"dt_limit": (1e-3, None)}  # Nemotron-H's clamp of dt
    hf.eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0))
    ours = Mamba2(config(), 0, **{**KEYS, **keys}).eval()
    ours.load_state_dict(from_hf_state(hf.state_dict()))
    assert hf_state(ours.state_dict()).keys() == hf.state_dict().keys()
    x = torch.randn(2, 11, 32)
    with torch.no_grad():
        assert (ours(x) - hf(x)).abs().max() < 1e-5


def test_causal():
    m = layer()
    x = torch.randn(1, 12, 32, dtype=torch.float64)
    x2 = x.clone()
    x2[:, 7:] = torch.randn(1, 5, 32, dtype=torch.float64)
    y, y2 = m(x), m(x2)
    assert (y[:, :7] - y2[:, :7]).abs().max() < 1e-12 and (y[:, 7:] - y2[:, 7:]).abs().max() > 1e-3


def test_cached_generation_equals_full_forward():
    m = layer()
    x = torch.randn(2, 11, 32, dtype=torch.float64)
    full = m(x)
    cache = LayerCache()
    outs, sizes = [m(x[:, :4], cache=cache)], []
    cache.offset = 4
    outs.append(m(x[:, 4:7], cache=cache))  # T > 1 from a state: the chunked form with an initial state
    for t in range(7, 11):
        cache.offset = t
        outs.append(m(x[:, t:t + 1], cache=cache))
        sizes.append(cache.bytes)
    assert (torch.cat(outs, 1) - full).abs().max() < 1e-10
    assert len(set(sizes)) == 1 and set(cache.state) == {"conv", "ssm"}
    assert cache.state["ssm"].shape == (2, 8, 8, 8) and cache.state["conv"].shape == (2, 64 + 32, 3)
    figures = m.figures()
    assert set(figures) == {"state_norm", "gate_mean", "dt_mean"} and 0 < figures["gate_mean"] < 1


def test_document_resets():
    a, b = torch.randn(1, 7, 32, dtype=torch.float64), torch.randn(1, 6, 32, dtype=torch.float64)
    packed = torch.cat((a, b), 1)
    doc = torch.tensor([[0] * 7 + [1] * 6])
    reset = layer(doc_mask=True)
    alone = reset(b)
    assert (reset(packed, doc=doc)[:, 7:] - alone).abs().max() < 1e-10
    cache = LayerCache()  # the same through the cache, the start inside the prompt and then at a generated token
    y = [reset(packed[:, :9], cache=cache, doc=doc)]
    for t in range(9, 13):
        cache.offset = t
        y.append(reset(packed[:, t:t + 1], cache=cache, doc=doc))
    assert (torch.cat(y, 1)[:, 7:] - alone).abs().max() < 1e-10
    cache, doc2 = LayerCache(), torch.tensor([[0] * 7 + [1] * 6])
    y = [reset(packed[:, :7], cache=cache, doc=doc2)]
    cache.offset = 7
    y.append(reset(packed[:, 7:], cache=cache, doc=doc2))  # the start is the first token of this forward
    assert (y[1] - alone).abs().max() < 1e-10
    plain = layer(doc_mask=False)
    assert (plain(packed, doc=doc)[:, 7:] - plain(b)).abs().max() > 1e-3


def test_geometry_and_keys():
    cfg = config()
    for keys in (KEYS, {}, {**KEYS, "n_groups": 1, "expand": 3, "head_dim": 16}):
        m = Mamba2(cfg, 0, **keys)
        g = Mamba2.geometry(cfg, **keys)
        assert g.n_params == sum(p.numel() for p in m.parameters())
        k, conv = m.conv.size, m.conv_dim
        assert g.state_numbers == m.n_heads * m.head_dim * m.d_state + (k - 1) * conv and g.flops_per_token > 0
    biased = resolve(GPTConfig(vocab_size=64, n_layer=2, d_model=32, n_head=4, bias=True))
    assert Mamba2.geometry(biased, **KEYS).n_params == sum(p.numel() for p in Mamba2(biased, 0, **KEYS).parameters())
    with pytest.raises(ValueError, match=r"mixer.head_dim=7 .*\[1, 2, 4, 8, 16, 32, 64\]"):
        Mamba2(cfg, 0, head_dim=7)
    with pytest.raises(ValueError, match=r"mixer.n_groups=3 .*\[1, 2, 4, 8\]"):
        Mamba2.geometry(cfg, head_dim=8, n_groups=3)
