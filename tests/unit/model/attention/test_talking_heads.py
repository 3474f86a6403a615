"""attention=talking_heads (lmlab/model/attention/talking.py) against Shazeer et al.'s formulas, by hand with learned
mixes away from the identity; MHA exactly at initialisation; the KV cache's logits those of a full forward."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS
from lmlab.model.attention.cache import KVCache
from lmlab.model.gpt import GPT
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.registry import build

B, T, C, NH = 2, 6, 16, 4
HS = C // NH


def _cfg(name: str = "talking_heads", **keys) -> GPTConfig:
    return resolve(GPTConfig(vocab_size=40, n_layer=2, d_model=C, n_head=NH, max_seq_len=16, bias=True,
                             attention={"name": name, **keys}, position={"name": "rope"}))


def _layer(cfg: GPTConfig):
    pos = build("position", POSITIONS, cfg.position, cfg.d_model, cfg.attn_head_dim, cfg.attn_heads,
                cfg.max_seq_len, cfg.train_len, {"name": "none"})
    return build("attention", ATTENTIONS, cfg.attention, cfg), pos


def _mixed(attn) -> None:
    with torch.no_grad():
        attn.logit_mix.copy_(0.5 * torch.randn(NH, NH))
        attn.weight_mix.copy_(0.5 * torch.randn(NH, NH))


def test_the_output_is_the_papers_formula_by_hand() -> None:
    attn, pos = _layer(_cfg())
    _mixed(attn)
    x = torch.randn(B, T, C)
    q, k, v = (x @ attn.c_attn.weight.T + attn.c_attn.bias).split(C, dim=-1)
    q, k, v = (t.view(B, T, NH, HS).transpose(1, 2) for t in (q, k, v))
    q, k = pos.rotate(q, k)
    P_l, P_w = attn.logit_mix + torch.eye(NH), attn.weight_mix + torch.eye(NH)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = torch.zeros(B, NH, T, HS)
    for b in range(B):
        L = torch.stack([q[b, g] @ k[b, g].T / math.sqrt(HS) for g in range(NH)])  # (g, T, T): each head's logits
        W = torch.stack([torch.softmax(sum(P_l[h, g] * L[g] for g in range(NH)).masked_fill(~causal, -math.inf), -1)
                         for h in range(NH)])
        for h in range(NH):
            out[b, h] = sum(P_w[h, g] * W[g] for g in range(NH)) @ v[b, h]
    expected = out.transpose(1, 2).reshape(B, T, C) @ attn.c_proj.weight.T + attn.c_proj.bias
    torch.testing.assert_close(attn(x, pos), expected, rtol=1e-5, atol=1e-6)
    weights, _ = attn.probs(x, pos)  # the monitor's weights are the mixed ones
    assert not torch.allclose(weights.sum(-1), torch.ones(B, NH, T), atol=1e-3)


def test_at_initialisation_it_is_mha() -> None:
    torch.manual_seed(1)
    talking, pos = _layer(_cfg())
    mha, _ = _layer(_cfg("mha"))
    missing = mha.load_state_dict(talking.state_dict(), strict=False)
    assert sorted(missing.unexpected_keys) == ["logit_mix", "weight_mix"] and not missing.missing_keys
    x = torch.randn(B, T, C)
    torch.testing.assert_close(talking(x, pos), mha(x, pos), rtol=1e-5, atol=1e-6)
    _mixed(talking)
    assert not torch.allclose(talking(x, pos), mha(x, pos), atol=1e-4)


def test_cached_generation_gives_the_full_forwards_logits() -> None:
    model = GPT(_cfg()).eval()
    for block in model.h:
        _mixed(block.attn)
    idx = torch.randint(0, 40, (B, 9))
    full = model(idx)
    cache = KVCache(len(model.h))
    steps = [model(idx[:, :5], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_the_mixes_learn_and_are_counted() -> None:
    cfg = _cfg()
    model = GPT(cfg)
    idx = torch.randint(0, 40, (B, 8))
    torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten()).backward()
    assert all(b.attn.logit_mix.grad.abs().sum() > 0 and b.attn.weight_mix.grad.abs().sum() > 0 for b in model.h)
    geometry = ATTENTIONS["talking_heads"].geometry(cfg)
    assert geometry.n_params == sum(p.numel() for p in model.h[0].attn.parameters())
    with pytest.raises(ValueError, match=r"attention\.sinks=true does not apply"):
        _layer(_cfg(sinks=True))
