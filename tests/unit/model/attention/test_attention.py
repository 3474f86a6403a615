"""Attention: the SDPA fast path against softmax(q kᵀ · scale + causal mask / bias) v written out by hand from the
fused c_attn weights, for every attention option and every position scheme; GQA's head grouping; the flags
(qk-norm, temperature, log-n scaling); `probs()`; and GPTConfig's head-count errors."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.registry import build

B, T, C, NH = 2, 7, 32, 4
# The options that share key/value heads and weigh them with one map of scaled dot products: the formulas below are
# theirs. The others say so (`scaled_dot_product = False`) and are checked against their own papers' equations:
# attention=diff in tests/unit/model/attention/test_window.py, MLA (keys and values from a latent) in tests/unit/model/attention/test_mla.py, each other in its own.
SHARING = sorted(a for a, option in ATTENTIONS.items() if option.scaled_dot_product)
HS = C // NH
TOL = dict(rtol=1e-5, atol=1e-6)


def _cfg(attention: str = "mha", **kw) -> GPTConfig:
    spec = {"name": attention, **kw.pop("flags", {})}
    n_kv = kw.pop("n_kv_head", 2 if attention == "gqa" else None)
    return resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=C, n_head=NH, n_kv_head=n_kv, max_seq_len=16,
                     attention=spec, bias=True, **kw))


def _attn(cfg: GPTConfig):
    return build("attention", ATTENTIONS, cfg.attention, cfg)


def _pos(cfg: GPTConfig, name: str = "none"):
    return build("position", POSITIONS, {"name": name}, cfg.d_model, cfg.attn_head_dim, cfg.attn_heads, cfg.max_seq_len,
                 cfg.train_len, {"name": "none"})


def _explicit(attn, pos, x: torch.Tensor, scale: float) -> torch.Tensor:
    """The attention output computed by hand: split c_attn's rows into q / k / v, repeat each kv head for its
    group of query heads (head h reads kv head h // group), softmax with a causal mask (or the position's bias)."""
    nh, nkv, hs = attn.n_head, attn.n_kv_head, attn.head_dim
    W, b = attn.c_attn.weight, attn.c_attn.bias
    q = (x @ W[: nh * hs].T + b[: nh * hs]).view(B, -1, nh, hs).transpose(1, 2)
    k = (x @ W[nh * hs: (nh + nkv) * hs].T + b[nh * hs: (nh + nkv) * hs]).view(B, -1, nkv, hs).transpose(1, 2)
    v = (x @ W[(nh + nkv) * hs:].T + b[(nh + nkv) * hs:]).view(B, -1, nkv, hs).transpose(1, 2)
    q, k = pos.rotate(q, k)
    group = nh // nkv
    k = torch.stack([k[:, h // group] for h in range(nh)], dim=1)
    v = torch.stack([v[:, h // group] for h in range(nh)], dim=1)
    n = x.size(1)
    logits = (q @ k.transpose(-2, -1)) * scale
    bias = pos.attn_bias(n, x.device, x.dtype)
    if bias is None:
        bias = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    y = torch.softmax(logits + bias, dim=-1) @ v  # (B, nh, T, hs)
    y = y.transpose(1, 2).reshape(B, n, nh * hs)
    return y @ attn.c_proj.weight.T + attn.c_proj.bias


@pytest.mark.parametrize("position", sorted(POSITIONS))
@pytest.mark.parametrize("attention", SHARING)
def test_sdpa_matches_explicit_attention(attention: str, position: str) -> None:
    cfg = _cfg(attention)
    attn, pos = _attn(cfg), _pos(cfg, position)
    x = torch.randn(B, T, C)
    torch.testing.assert_close(attn(x, pos), _explicit(attn, pos, x, 1 / math.sqrt(HS)), **TOL)


@pytest.mark.parametrize("position", sorted(POSITIONS))
@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
def test_attention_is_causal(attention: str, position: str) -> None:
    cfg = _cfg(attention, position={"name": position})
    if attention == "diff" and position in ("alibi", "t5", "fire"):  # a bias per head, two maps a head: refused
        with pytest.raises(ValueError, match=f"attention=diff with position={position}"):
            _attn(cfg)
        return
    attn, pos = _attn(cfg), _pos(cfg, position)
    x = torch.randn(B, T, C)
    x2 = x.clone()
    x2[:, 4:] = torch.randn(B, T - 4, C)
    y, y2 = attn(x, pos), attn(x2, pos)
    torch.testing.assert_close(y[:, :4], y2[:, :4], rtol=0, atol=1e-6)
    assert not torch.allclose(y[:, 4:], y2[:, 4:], atol=1e-4)


def test_kv_heads_per_option() -> None:
    assert ATTENTIONS["mha"].kv_heads(8, None) == 8
    assert ATTENTIONS["mqa"].kv_heads(8, None) == 1
    assert ATTENTIONS["gqa"].kv_heads(8, 2) == 2


def test_mqa_has_one_kv_head() -> None:
    cfg = _cfg("mqa")
    attn = _attn(cfg)
    assert cfg.kv_heads == 1 and attn.n_kv_head == 1
    assert attn.c_attn.weight.shape == ((NH + 2) * HS, C)
    q, k, v = attn.qkv(torch.randn(B, T, C), _pos(cfg))
    assert q.shape == (B, NH, T, HS) and k.shape == v.shape == (B, 1, T, HS)


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_gqa_shapes(n_kv: int) -> None:
    cfg = _cfg("gqa", n_kv_head=n_kv)
    attn = _attn(cfg)
    assert attn.c_attn.weight.shape == ((NH + 2 * n_kv) * HS, C)
    q, k, v = attn.qkv(torch.randn(B, T, C), _pos(cfg))
    assert q.shape == (B, NH, T, HS) and k.shape == v.shape == (B, n_kv, T, HS)


@pytest.mark.parametrize("position", ["none", "rope", "alibi"])
def test_gqa_with_all_kv_heads_equals_mha(position: str) -> None:
    mha_cfg, gqa_cfg = _cfg("mha"), _cfg("gqa", n_kv_head=NH)
    mha, gqa = _attn(mha_cfg), _attn(gqa_cfg)
    gqa.load_state_dict(mha.state_dict())
    x = torch.randn(B, T, C)
    torch.testing.assert_close(gqa(x, _pos(gqa_cfg, position)), mha(x, _pos(mha_cfg, position)), rtol=0, atol=0)


def test_gqa_groups_adjacent_query_heads() -> None:
    """With 2 kv heads, query heads 0,1 read kv head 0 and 2,3 read kv head 1: zeroing kv head 1's value rows
    zeroes exactly the outputs of query heads 2 and 3."""
    cfg = _cfg("gqa", n_kv_head=2)
    attn = _attn(cfg)
    with torch.no_grad():
        attn.c_attn.weight[(NH + 2) * HS + HS:] = 0  # value rows of kv head 1
        attn.c_attn.bias[(NH + 2) * HS + HS:] = 0
        attn.c_proj.weight.copy_(torch.eye(C))
        attn.c_proj.bias.zero_()
    y = attn(torch.randn(B, T, C), _pos(cfg)).view(B, T, NH, HS)
    assert y[:, :, 2:].abs().max() == 0
    assert y[:, :, :2].abs().min() > 0


def test_qk_norm_normalises_q_and_k() -> None:
    cfg = _cfg("mha", flags={"qk_norm": True})
    attn, pos = _attn(cfg), _pos(cfg)
    x = torch.randn(B, T, C) * 50
    q, k, _ = attn.qkv(x, pos)
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones(B, NH, T), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k.pow(2).mean(-1), torch.ones(B, NH, T), rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        attn.q_norm.fill_(2.0)
        attn.k_norm.fill_(3.0)
    q, k, _ = attn.qkv(x, pos)
    torch.testing.assert_close(q.pow(2).mean(-1).sqrt(), torch.full((B, NH, T), 2.0), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(k.pow(2).mean(-1).sqrt(), torch.full((B, NH, T), 3.0), rtol=1e-4, atol=1e-4)


def test_qk_norm_eps_is_the_rms_norms_epsilon() -> None:
    """q / sqrt(mean(q²) + eps) per head (Qwen3 takes the model's rms_norm_eps); unset, torch's default (the dtype's
    machine epsilon) as before. A large eps on small inputs shows it: the RMS falls well below 1."""
    x = torch.randn(B, T, C) * 0.01
    outs = {}
    for eps in (None, 0.5):
        cfg = _cfg("mha", flags={"qk_norm": True, **({"qk_norm_eps": eps} if eps else {})})
        torch.manual_seed(0)
        attn = _attn(cfg)
        q, _, _ = attn.qkv(x, _pos(cfg))
        raw = attn.c_attn(x)[..., :C].view(B, T, NH, HS).transpose(1, 2)
        expected = raw / (raw.pow(2).mean(-1, keepdim=True) + (eps or torch.finfo(torch.float32).eps)).sqrt()
        torch.testing.assert_close(q, expected, rtol=1e-5, atol=1e-6)
        outs[eps] = q
    assert outs[0.5].pow(2).mean() < 0.1 < outs[None].pow(2).mean()
    with pytest.raises(ValueError, match=r"attention\.qk_norm_eps=0\.5 needs attention\.qk_norm=true"):
        _attn(_cfg("mha", flags={"qk_norm_eps": 0.5}))


def test_qk_norm_bounds_logits() -> None:
    """With unit-RMS q and k, |q·k| ≤ hs (Cauchy–Schwarz), so |logit| ≤ hs / sqrt(hs) = sqrt(hs) at any input scale;
    without qk-norm the same weights give logits far past the bound."""
    plain_cfg, norm_cfg = _cfg("mha"), _cfg("mha", flags={"qk_norm": True})
    plain, normed = _attn(plain_cfg), _attn(norm_cfg)
    normed.load_state_dict(plain.state_dict(), strict=False)
    x = torch.randn(B, T, C) * 100
    _, max_plain = plain.probs(x, _pos(plain_cfg))
    _, max_normed = normed.probs(x, _pos(norm_cfg))
    assert max_normed.max() <= math.sqrt(HS) + 1e-4
    assert max_plain.max() > 10 * math.sqrt(HS)
    assert {n for n, _ in normed.named_parameters()} - {n for n, _ in plain.named_parameters()} == {"q_norm",
                                                                                                     "k_norm"}


@pytest.mark.parametrize("temperature", [0.5, 2.0, 4.0])
def test_temperature_divides_logits(temperature: float) -> None:
    cfg1, cfgt = _cfg("mha"), _cfg("mha", flags={"temperature": temperature})
    a1, at = _attn(cfg1), _attn(cfgt)
    at.load_state_dict(a1.state_dict())
    assert at.scale == pytest.approx(1 / (math.sqrt(HS) * temperature))
    x = torch.randn(B, T, C)
    p1, m1 = a1.probs(x, _pos(cfg1))
    pt, mt = at.probs(x, _pos(cfgt))
    torch.testing.assert_close(mt, m1 / temperature, **TOL)
    torch.testing.assert_close(pt, torch.softmax(p1.log() / temperature, dim=-1), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(at(x, _pos(cfgt)), _explicit(at, _pos(cfgt), x, at.scale), **TOL)


@pytest.mark.parametrize("position", sorted(POSITIONS))
@pytest.mark.parametrize("attention", SHARING)
def test_probs_rows_sum_to_one_and_are_causal(attention: str, position: str) -> None:
    cfg = _cfg(attention)
    attn, pos = _attn(cfg), _pos(cfg, position)
    probs, max_logit = attn.probs(torch.randn(B, T, C), pos)
    assert probs.shape == (B, NH, T, T) and max_logit.shape == (B, NH)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, NH, T), **TOL)
    assert torch.equal(probs.triu(1), torch.zeros_like(probs))
    assert torch.equal(probs[..., 0, 0], torch.ones(B, NH))  # the first token sees only itself
    assert torch.isfinite(max_logit).all()


def test_probs_match_the_forward_path() -> None:
    cfg = _cfg("gqa")
    attn, pos = _attn(cfg), _pos(cfg, "rope")
    x = torch.randn(B, T, C)
    probs, _ = attn.probs(x, pos)
    _, _, v = attn.qkv(x, pos)
    y = probs @ v.repeat_interleave(NH // 2, dim=1)
    expected = attn.c_proj(y.transpose(1, 2).reshape(B, T, C))
    torch.testing.assert_close(attn(x, pos), expected, **TOL)


def test_logn_scaling_past_the_trained_length() -> None:
    """q at 1-based position n is multiplied by max(1, ln n / ln L) once the sequence is longer than L."""
    L = 4
    cfg_plain = _cfg("mha", train_len=L)
    cfg_logn = _cfg("mha", train_len=L, flags={"logn_scaling": True})
    plain, logn = _attn(cfg_plain), _attn(cfg_logn)
    logn.load_state_dict(plain.state_dict())
    x = torch.randn(B, 10, C)
    q0, k0, v0 = plain.qkv(x, _pos(cfg_plain))
    q1, k1, v1 = logn.qkv(x, _pos(cfg_logn))
    factor = torch.tensor([max(1.0, math.log(n) / math.log(L)) for n in range(1, 11)])
    torch.testing.assert_close(q1, q0 * factor[:, None], **TOL)
    assert torch.equal(k1, k0) and torch.equal(v1, v0)
    # within the trained length nothing changes
    q0s, _, _ = plain.qkv(x[:, :L], _pos(cfg_plain))
    q1s, _, _ = logn.qkv(x[:, :L], _pos(cfg_logn))
    assert torch.equal(q0s, q1s)


# ---- GPTConfig errors ----------------------------------------------------------------------------------------


def test_d_model_not_divisible_by_n_head() -> None:
    with pytest.raises(ValueError, match=r"model\.d_model=30 is not divisible by model\.n_head=4.*\[1, 2, 3, 5, 6"):
        resolve(GPTConfig(vocab_size=50, d_model=30, n_head=4))


@pytest.mark.parametrize("n_kv", [3, 8, 0])
def test_n_kv_head_must_divide_n_head(n_kv: int) -> None:
    with pytest.raises(ValueError, match=r"model\.n_kv_head.*model\.n_head=4.*\[1, 2, 4\]"):
        resolve(GPTConfig(vocab_size=50, d_model=32, n_head=4, n_kv_head=n_kv, attention={"name": "gqa"}))


def test_gqa_needs_n_kv_head() -> None:
    with pytest.raises(ValueError, match=r"attention=gqa needs model\.n_kv_head"):
        resolve(GPTConfig(vocab_size=50, d_model=32, n_head=4, attention={"name": "gqa"}))


def test_unknown_attention_flag() -> None:
    with pytest.raises(ValueError, match=r"attention='mha' does not take \['rope'\]"):
        resolve(GPTConfig(vocab_size=50, d_model=32, n_head=4, attention={"name": "mha", "rope": True}))
