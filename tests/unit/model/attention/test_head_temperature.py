"""attention.head_temperature: head h's logits times exp(s_h), s_h learnt from 0. Against the same attention with
head h's query rows of the fused projection scaled by exp(s_h) by hand; the standard model at init; the weights the
sizes count; gradients reach s_h from a model composed from YAML; MLA, which makes its queries its own way, refuses
it by key."""

from __future__ import annotations

import pytest
import torch

from lmlab import build_model, compose
from lmlab.config import GPTConfig
from lmlab.model.attention import MHA
from lmlab.model.gpt import GPT, validate

B, T, C, NH = 2, 9, 16, 4
HS = C // NH
TOL = dict(rtol=1e-5, atol=1e-6)


def _model(head_temperature: bool, **attention) -> GPT:
    cfg = GPTConfig(vocab_size=30, n_layer=2, d_model=C, n_head=NH, max_seq_len=16, position={"name": "rope"},
                    attention={"name": "gqa", "head_temperature": head_temperature, **attention}, n_kv_head=2)
    torch.manual_seed(0)
    return GPT(validate(cfg)).eval()


@pytest.mark.parametrize("attention", [{}, {"window": 4}, {"bias": True}])
def test_it_is_the_query_rows_scaled_per_head(attention: dict) -> None:
    """exp(s_h) times head h's query rows of c_attn (its bias too), by hand: the same model outputs."""
    bias = attention.pop("bias", False)
    tempered, plain = (_model(on, **attention) for on in (True, False))
    if bias:
        tempered, plain = (_biased(on) for on in (True, False))
    s = torch.tensor([0.5, -1.0, 0.0, 2.0])
    idx = torch.randint(0, 30, (B, T))
    with torch.no_grad():
        for block in tempered.h:
            block.attn.log_temperature.copy_(s)
        plain.load_state_dict({k: v for k, v in tempered.state_dict().items() if "log_temperature" not in k})
        before = plain(idx)
        rows = s.exp().repeat_interleave(HS)
        for block in plain.h:
            block.attn.c_attn.weight[:NH * HS].mul_(rows[:, None])
            if block.attn.c_attn.bias is not None:
                block.attn.c_attn.bias[:NH * HS].mul_(rows)
        torch.testing.assert_close(tempered(idx), plain(idx), **TOL)
        assert not torch.allclose(tempered(idx), before, **TOL)  # the temperatures changed the logits


def test_under_qk_norm_it_scales_the_normed_queries() -> None:
    tempered = _model(True, qk_norm=True)
    attn, s = tempered.h[1].attn, torch.tensor([0.5, -1.0, 0.0, 2.0])
    x = torch.randn(B, T, C)
    with torch.no_grad():
        q0 = attn.qkv(x, tempered.pos)[0]
        attn.log_temperature.copy_(s)
        q1 = attn.qkv(x, tempered.pos)[0]
    torch.testing.assert_close(q1, q0 * s.exp()[:, None, None], **TOL)
    assert q0.pow(2).mean(-1).sqrt().sub(1).abs().max() < 1e-3  # normed (RoPE keeps the norm), then scaled


def _biased(on: bool) -> GPT:
    cfg = GPTConfig(vocab_size=30, n_layer=2, d_model=C, n_head=NH, max_seq_len=16, position={"name": "rope"},
                    attention={"name": "gqa", "head_temperature": on}, n_kv_head=2, bias=True)
    torch.manual_seed(0)
    return GPT(validate(cfg)).eval()


def test_at_init_it_is_the_standard_model_and_the_sizes_count_its_weights() -> None:
    tempered, plain = _model(True), _model(False)
    plain.load_state_dict({k: v for k, v in tempered.state_dict().items() if "log_temperature" not in k})
    idx = torch.randint(0, 30, (B, T))
    with torch.no_grad():
        torch.testing.assert_close(tempered(idx), plain(idx), **TOL)
    n = sum(p.numel() for p in tempered.parameters()) - sum(p.numel() for p in plain.parameters())
    assert n == 2 * NH  # one per head per layer
    cfg = tempered.cfg
    assert MHA.geometry(cfg, head_temperature=True).n_params - MHA.geometry(cfg).n_params == NH


def test_it_learns_from_a_composed_model_and_mla_refuses_it_by_key() -> None:
    model = build_model(compose(["model=tiny", "attention.head_temperature=true"]))
    idx = torch.randint(0, 50, (2, 16))
    logits = model(idx)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
    grads = [block.attn.log_temperature.grad for block in model.h]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)
    with pytest.raises(ValueError, match=r"attention\.head_temperature=true acts through the attention's "
                                         r"before_rotation, which MLA computes its own way"):
        build_model(compose(["model=tiny", "attention=mla", "attention.head_temperature=true"]))
