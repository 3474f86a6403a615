"""attention=cosine (lmlab/model/attention/cosine.py) against Swin V2's formula by hand, τ·cos(q, k) with learned
per-head τ away from its start; the logits bounded by τ and blind to the size of q and k; τ learned and clamped; the
keys that do not apply refused by name."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS
from lmlab.model.gpt import GPT
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.registry import build

B, T, C, NH = 2, 6, 16, 4
HS = C // NH


def _cfg(position: str = "rope", **keys) -> GPTConfig:
    return resolve(GPTConfig(vocab_size=40, n_layer=2, d_model=C, n_head=NH, max_seq_len=16, bias=True,
                             attention={"name": "cosine", **keys}, position={"name": position}))


def _layer(cfg: GPTConfig):
    pos = build("position", POSITIONS, cfg.position, cfg.d_model, cfg.attn_head_dim, cfg.attn_heads,
                cfg.max_seq_len, cfg.train_len, {"name": "none"})
    attn = build("attention", ATTENTIONS, cfg.attention, cfg)
    with torch.no_grad():
        attn.log_tau.copy_(torch.log(torch.tensor([2.0, 5.0, 10.0, 30.0])))  # a τ of its own per head
    return attn, pos


def test_the_output_is_the_formula_by_hand() -> None:
    torch.manual_seed(0)
    attn, pos = _layer(_cfg())
    x = torch.randn(B, T, C)
    q, k, v = (x @ attn.c_attn.weight.T + attn.c_attn.bias).split(C, dim=-1)
    q, k, v = (t.view(B, T, NH, HS).transpose(1, 2) for t in (q, k, v))
    q, k = pos.rotate(q, k)
    tau = torch.tensor([2.0, 5.0, 10.0, 30.0])
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    out = torch.zeros(B, NH, T, HS)
    for b in range(B):
        for h in range(NH):
            cos = torch.stack([torch.stack([q[b, h, i] @ k[b, h, j] / (q[b, h, i].norm() * k[b, h, j].norm())
                                            for j in range(T)]) for i in range(T)])
            out[b, h] = torch.softmax((tau[h] * cos).masked_fill(~causal, -math.inf), -1) @ v[b, h]
    expected = out.transpose(1, 2).reshape(B, T, C) @ attn.c_proj.weight.T + attn.c_proj.bias
    torch.testing.assert_close(attn(x, pos), expected, rtol=1e-5, atol=1e-6)
    weights, max_logit = attn.probs(x, pos)  # the monitor's: rows of a softmax, logits at most τ
    torch.testing.assert_close(weights.sum(-1), torch.ones(B, NH, T))
    assert (max_logit <= tau + 1e-5).all() and (max_logit > 0.5 * tau).all()


def test_the_logits_do_not_grow_with_the_size_of_q_and_k() -> None:
    """Scaling the query and key projections by 10 changes nothing (dot-product attention would sharpen)."""
    torch.manual_seed(1)
    attn, pos = _layer(_cfg())
    x = torch.randn(B, T, C)
    before = attn(x, pos)
    with torch.no_grad():
        attn.c_attn.weight[: 2 * C].mul_(10.0)
        attn.c_attn.bias[: 2 * C].mul_(10.0)
    torch.testing.assert_close(attn(x, pos), before, rtol=1e-5, atol=1e-6)


def test_tau_is_learned_per_head_and_clamped() -> None:
    torch.manual_seed(2)
    model = GPT(_cfg(position="alibi"))
    assert torch.allclose(model.h[0].attn.tau, torch.full((NH,), 10.0))  # tau_init, whatever the init scheme
    idx = torch.randint(0, 40, (B, 12))
    model(idx, idx).backward()
    assert (model.h[0].attn.log_tau.grad.abs() > 0).all()
    with torch.no_grad():
        model.h[0].attn.log_tau.fill_(10.0)  # e^10 ≫ 100
    assert torch.allclose(model.h[0].attn.tau, torch.full((NH,), 100.0))


@pytest.mark.parametrize(("keys", "message"), [
    ({"score": "relu2"}, r"attention\.score='relu2' does not apply"),
    ({"temperature": 2.0}, r"attention\.temperature=2\.0 does not apply"),
    ({"logn_scaling": True}, r"attention\.logn_scaling=true does not apply"),
    ({"tau_init": 500.0}, r"attention\.tau_init=500\.0 is above"),
])
def test_the_keys_that_do_not_apply_are_refused_by_name(keys: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPT(_cfg(**keys))
