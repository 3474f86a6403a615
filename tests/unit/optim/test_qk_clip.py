"""QK-clip (optim.qk_clip, Kimi K2): a head's logits scaled by exactly γ_h through its weights (MHA: √γ on W_q and W_k;
a GQA group's shared key √min γ), the clip over a model bringing every head over τ down to τ and leaving the others
bit for bit, and the options it cannot honour refused by key before training."""

from __future__ import annotations

import pytest
import torch

from lmlab import compose, names
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.optim.qk_clip import QKClip, attention_layers, gammas
from lmlab.run.checks import check_config

TINY = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16)


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, **kw}))
    with torch.no_grad():  # logits well away from 0, and different per head
        for _, attn in attention_layers(model):
            attn.c_attn.weight.mul_(torch.linspace(2, 6, attn.c_attn.weight.size(0))[:, None])
    return model


def _logits(model: GPT, attn, x: torch.Tensor) -> torch.Tensor:
    """q·kᵀ·scale per query head (B, nh, T, T), from the layer's own projections and positions."""
    q, k, _ = attn.qkv(x, model.pos, 0, None, mix=False)
    k = k.repeat_interleave(attn.n_head // attn.n_kv_head, dim=1)
    return q @ k.transpose(-2, -1) * attn.scale


def test_gammas() -> None:
    assert gammas(torch.tensor([50.0, 100.0, 200.0, 400.0]), 100.0).tolist() == [1.0, 1.0, 0.5, 0.25]
    s = torch.tensor([0.5764681100845337, 0.1])  # a head exactly at τ is not clipped (τ · (1/S) is 1 - 1 ulp here)
    assert gammas(s, float(s[0])).tolist() == [1.0, 1.0]


@pytest.mark.parametrize(("attention", "kv"), [("mha", 4), ("gqa", 2), ("mqa", 1)])
def test_clip_logits_scales_each_heads_logits_by_its_gamma(attention: str, kv: int) -> None:
    """After clip_logits(γ) the same input gives logits γ_h times the old ones, head by head (biases on, rotary)."""
    model = _model(attention={"name": attention}, n_kv_head=kv, bias=True)
    attn = model.h[0].attn
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        before = _logits(model, attn, x)
        gamma = torch.tensor([1.0, 0.5, 0.25, 0.8])
        attn.clip_logits(gamma)
        after = _logits(model, attn, x)
    torch.testing.assert_close(after, before * gamma[None, :, None, None], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_lora_rank", [None, 16])
def test_mla_scales_each_heads_logits_by_its_gamma_by_kimis_rule(q_lora_rank: int | None) -> None:
    """MLA (Kimi K2's rule): a head's q_nope and k_nope rows by √γ_h, its q_rope rows by γ_h, the rotary key shared by
    all heads and the values untouched (their memory keys likewise: the nope part by √γ_h), so that q·k, hence every
    logit of head h, is γ_h times the old one; with a full and with a compressed query."""
    model = _mla(q_lora_rank=q_lora_rank, mem_kv=2)
    attn = model.h[0].attn
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        before = attn.probs(x, model.pos)[1]  # (B, nh): each head's max logit, the memory keys' included
        q, k, v = attn.qkv(x, model.pos, 0, None, mix=False)
        mem_k, mem_v = (t.clone() for t in attn.extras(None)["mem"])
        kv_a, values = attn.kv_a.weight.clone(), attn.kv_b.weight.view(4, -1, attn.rank)[:, attn.nope:].clone()
        gamma = torch.tensor([1.0, 0.5, 0.25, 0.8])
        attn.clip_logits(gamma)
        q2, k2, v2 = attn.qkv(x, model.pos, 0, None, mix=False)
        logits = (q @ k.transpose(-2, -1), q2 @ k2.transpose(-2, -1))
        mem = (q @ mem_k.transpose(-2, -1), q2 @ attn.extras(None)["mem"][0].transpose(-2, -1))
        after = attn.probs(x, model.pos)[1]
    g = gamma[None, :, None, None]
    torch.testing.assert_close(logits[1], logits[0] * g, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mem[1], mem[0] * g, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, before * gamma, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v2, v)
    torch.testing.assert_close(attn.extras(None)["mem"][1], mem_v)
    assert torch.equal(attn.kv_a.weight, kv_a)  # the latent and the shared rotary key: every head reads them
    assert torch.equal(attn.kv_b.weight.view(4, -1, attn.rank)[:, attn.nope:], values)
    # the rope part of the key is shared: q_rope takes the whole γ, q_nope and k_nope √γ each
    torch.testing.assert_close(q2[..., attn.nope:], q[..., attn.nope:] * g, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q2[..., :attn.nope], q[..., :attn.nope] * g.sqrt(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(k2[..., attn.nope:], k[..., attn.nope:])


def test_the_clip_brings_mla_heads_over_tau_to_tau() -> None:
    """The clip over an MLA model: each head over τ ends at τ, on the same inputs, and the rest keep their max logit."""
    model = _mla(n_layer=2)
    model.train()
    clip = QKClip(model, threshold=1.0)
    clip.recording = True
    model(torch.randint(0, 50, (2, 16)))
    clip.recording = False
    inputs = dict(clip.inputs)
    clip.measure()
    s = clip.max_logits.clone()
    clip.threshold = tau = float(s.flatten().sort().values[s.numel() // 2])
    assert clip.clip()[names.QK_CLIPPED_HEADS] == float((s > tau).sum()) > 0
    clip.inputs = inputs
    clip.measure()
    over = s > tau
    torch.testing.assert_close(clip.max_logits[over], torch.full_like(s[over], tau), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(clip.max_logits[~over], s[~over], rtol=1e-5, atol=1e-5)


def _mla(n_layer: int = 1, **params) -> GPT:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**TINY, "n_layer": n_layer}, attention={"name": "mla", **params}))
    with torch.no_grad():  # logits well away from 0, different per head
        for _, attn in attention_layers(model):
            for w in (attn.q_proj or attn.q_b, attn.kv_b):
                w.weight.mul_(torch.linspace(2, 6, w.weight.size(0))[:, None])
    return model


def test_mha_splits_the_factor_evenly_between_query_and_key() -> None:
    """Kimi's rule for a head with its own key: W_q and W_k rows each by √γ; the values untouched."""
    model = _model()
    attn = model.h[0].attn
    w = attn.c_attn.weight.detach().clone()
    gamma = torch.tensor([1.0, 0.25, 1.0, 0.64])
    attn.clip_logits(gamma)
    rows = torch.cat([gamma.sqrt().repeat_interleave(8), gamma.sqrt().repeat_interleave(8), torch.ones(32)])
    torch.testing.assert_close(attn.c_attn.weight.detach(), w * rows[:, None])


def test_the_clip_brings_heads_over_tau_to_tau_and_leaves_the_rest() -> None:
    """Record a forward, measure S_h, clip at τ between the smallest and the largest S: every head's max logit is
    then ≤ τ (those that were over: = τ) and the layers with no head over τ keep their weights bit for bit."""
    model = _model(n_layer=3)
    model.train()
    idx = torch.randint(0, 50, (2, 16))
    clip = QKClip(model, threshold=1.0)
    clip.recording = True
    model(idx)
    clip.recording = False
    inputs = dict(clip.inputs)  # each layer's input, to measure again on exactly these (a clip changes the next's)
    clip.measure()
    s = clip.max_logits.clone()  # (layers, heads)
    tau = float(s.flatten().sort().values[s.numel() // 2])
    clip.threshold = tau
    untouched = [i for i, row in enumerate(s) if bool((row <= tau).all())]
    kept = {i: model.h[i].attn.c_attn.weight.detach().clone() for i in untouched}
    figures = clip.clip()
    assert figures[names.QK_CLIPPED_HEADS] == float((s > tau).sum()) > 0
    assert figures[names.QK_MAX_LOGIT] == pytest.approx(float(s.max()))
    for i, w in kept.items():
        assert torch.equal(model.h[i].attn.c_attn.weight, w)
    clip.inputs = inputs
    clip.measure()
    after = clip.max_logits
    over = s > tau
    torch.testing.assert_close(after[over], torch.full_like(after[over], tau), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(after[~over], s[~over], rtol=1e-5, atol=1e-5)
    clip.remove()


def test_nothing_is_recorded_in_eval_or_when_not_asked() -> None:
    model = _model()
    clip = QKClip(model, threshold=1.0)
    model(torch.randint(0, 50, (1, 8)))  # not recording
    clip.recording = True
    model.eval()
    model(torch.randint(0, 50, (1, 8)))  # a validation forward
    assert clip.inputs == {}
    clip.measure()
    assert clip.max_logits is None and clip.clip() == {}


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.qk_clip=0"], "optim.qk_clip"),
    (["optim.qk_clip=-1"], "optim.qk_clip"),
    (["optim.qk_clip=100", "attention=diff"], "optim.qk_clip=100 with attention=diff"),
    (["optim.qk_clip=100", "attention=talking_heads"], "attention=talking_heads"),
    (["optim.qk_clip=100", "attention=cosine"], "attention=cosine"),
    (["optim.qk_clip=100", "attention.qk_norm=true"], "attention.qk_norm=true"),
    (["optim.qk_clip=100", "block=gau"], "no attention layer"),
])
def test_refused_by_key_before_training(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_config(compose(["trainer.max_steps=500", *overrides]))


def test_accepted_with_muon_and_gqa_and_mla() -> None:
    check_config(compose(["trainer.max_steps=500", "optim=muon", "optim.qk_clip=100", "attention=gqa",
                          "model.n_kv_head=2"]))
    check_config(compose(["trainer.max_steps=500", "optim=muon", "optim.qk_clip=100", "attention=mla"]))
