"""Init schemes: the standard deviations each scheme promises, measured on matrices large enough for a few-percent
estimate (d_model 128: 16k–65k entries each); residual projections; DeepNet's β under placement=deepnorm; and, for
every scheme, zero biases, untouched norm weights and a tied head that stays the embedding's tensor."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.ffn import FFNS
from lmlab.model.gpt import GPT
from lmlab.model.init import INITS

C, NL, V = 128, 2, 50
REL = 0.05  # a 16k-sample std estimate is good to ~0.6%; 5% still separates every pair of formulas below


def _model(init: dict, **kw) -> GPT:
    kw = {"vocab_size": V, "n_layer": NL, "d_model": C, "n_head": 4, "max_seq_len": 16, "init": init, **kw}
    return GPT(GPTConfig(**kw))


def _std(t: torch.Tensor) -> float:
    return t.detach().float().std().item()


def _xavier(fan_in: int, fan_out: int, gain: float = 1.0) -> float:
    return gain * math.sqrt(2 / (fan_in + fan_out))


# ---- gpt2 ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("std", [0.02, 0.05])
def test_gpt2_stds(std: float) -> None:
    model = _model({"name": "gpt2", "std": std})
    assert _std(model.wte.weight) == pytest.approx(std, rel=REL)
    for block in model.h:
        assert _std(block.attn.c_attn.weight) == pytest.approx(std, rel=REL)
        assert _std(block.mlp.c_fc.weight) == pytest.approx(std, rel=REL)
        assert _std(block.attn.c_proj.weight) == pytest.approx(std / math.sqrt(2 * NL), rel=REL)
        assert abs(block.attn.c_attn.weight.mean().item()) < std / 20


def test_gpt2_residual_scaling_follows_depth() -> None:
    deep = _model({"name": "gpt2"}, n_layer=8)
    assert _std(deep.h[0].attn.c_proj.weight) == pytest.approx(0.02 / 4, rel=REL)  # 1 / sqrt(16)


@pytest.mark.parametrize("ffn", sorted(FFNS))
@pytest.mark.parametrize("init", ["gpt2", "small"])
def test_ffn_output_projection_is_a_residual_projection(init: str, ffn: str) -> None:
    model = _model({"name": init}, ffn={"name": ffn, "hidden_mult": 4, "multiple_of": 64})
    expected = 0.02 / math.sqrt(2 * NL) if init == "gpt2" else 2 / (NL * math.sqrt(C))
    for block in model.h:
        assert _std(block.mlp.c_proj.weight) == pytest.approx(expected, rel=REL)


def test_gpt2_learned_position_and_untied_head() -> None:
    model = _model({"name": "gpt2"}, position={"name": "learned"}, max_seq_len=512, tie_embeddings=False)
    assert _std(model.pos.wpe.weight) == pytest.approx(0.02, rel=REL)
    assert _std(model.lm_head.weight) == pytest.approx(0.02, rel=REL)
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()


# ---- small, xavier ------------------------------------------------------------------------------------------


def test_small_stds() -> None:
    model = _model({"name": "small"})
    base = math.sqrt(2 / (5 * C))
    assert _std(model.wte.weight) == pytest.approx(base, rel=REL)
    for block in model.h:
        assert _std(block.attn.c_attn.weight) == pytest.approx(base, rel=REL)
        assert _std(block.mlp.c_fc.weight) == pytest.approx(base, rel=REL)
        assert _std(block.attn.c_proj.weight) == pytest.approx(2 / (NL * math.sqrt(C)), rel=REL)


@pytest.mark.parametrize("gain", [1.0, 2.0])
def test_xavier_stds(gain: float) -> None:
    model = _model({"name": "xavier", "gain": gain})
    assert _std(model.wte.weight) == pytest.approx(C**-0.5, rel=REL)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.weight is not model.wte.weight:
            start = 0  # a fused projection (QKV, GLU gate+up) is initialised as its separate matrices
            for rows in getattr(module, "fused", (module.weight.size(0),)):
                part = module.weight[start:start + rows]
                assert _std(part) == pytest.approx(_xavier(part.size(1), rows, gain), rel=REL), name
                start += rows


# ---- deepnet ------------------------------------------------------------------------------------------------


def _qkv_rows(attn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, kv = attn.n_head * attn.head_dim, attn.n_kv_head * attn.head_dim
    w = attn.c_attn.weight
    return w[:d], w[d:d + kv], w[d + kv:]


@pytest.mark.parametrize(("placement", "n_layer"), [("deepnorm", 2), ("deepnorm", 6), ("pre", 2)])
def test_deepnet_value_output_ffn_gain(placement: str, n_layer: int) -> None:
    model = _model({"name": "deepnet"}, placement={"name": placement}, n_layer=n_layer)
    beta = (8 * n_layer) ** -0.25 if placement == "deepnorm" else 1.0
    for block in model.h:
        _, _, v = _qkv_rows(block.attn)
        assert _std(v) == pytest.approx(_xavier(C, v.shape[0], beta), rel=REL)
        assert _std(block.attn.c_proj.weight) == pytest.approx(_xavier(C, C, beta), rel=REL)
        hidden = block.mlp.c_fc.weight.shape[0]
        assert _std(block.mlp.c_fc.weight) == pytest.approx(_xavier(C, hidden, beta), rel=REL)
        assert _std(block.mlp.c_proj.weight) == pytest.approx(_xavier(hidden, C, beta), rel=REL)


def test_deepnet_gqa_value_rows() -> None:
    model = _model({"name": "deepnet"}, placement={"name": "deepnorm"}, attention={"name": "gqa"}, n_kv_head=2)
    _, _, v = _qkv_rows(model.h[0].attn)
    assert v.shape == (2 * 32, C)
    assert _std(v) == pytest.approx(_xavier(C, 64, (8 * NL) ** -0.25), rel=REL)


def test_deepnet_query_key_rows_gain_one() -> None:
    model = _model({"name": "deepnet"}, placement={"name": "deepnorm"})
    for block in model.h:
        q, k, _ = _qkv_rows(block.attn)
        assert _std(q) == pytest.approx(_xavier(C, q.shape[0]), rel=REL)
        assert _std(k) == pytest.approx(_xavier(C, k.shape[0]), rel=REL)


def test_deepnet_query_key_rows_not_scaled_by_beta() -> None:
    """q/k keep gain 1 under deepnorm: the same std as under pre (β = 1), not β times it."""
    deep = _model({"name": "deepnet"}, placement={"name": "deepnorm"}, n_layer=6)
    pre = _model({"name": "deepnet"}, placement={"name": "pre"}, n_layer=6)
    q_deep, _, v_deep = _qkv_rows(deep.h[0].attn)
    q_pre, _, v_pre = _qkv_rows(pre.h[0].attn)
    assert _std(q_deep) == pytest.approx(_std(q_pre), rel=REL)
    assert _std(v_deep) / _std(v_pre) == pytest.approx(48**-0.25, rel=REL)


# ---- every scheme -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["layer", "scale"])
@pytest.mark.parametrize("name", sorted(INITS))
def test_biases_zero_norms_untouched_head_tied(name: str, norm: str) -> None:
    model = GPT(GPTConfig(vocab_size=V, n_layer=2, d_model=32, n_head=4, max_seq_len=16, bias=True,
                          norm={"name": norm}, init={"name": name}, attention={"name": "mha", "qk_norm": True}))
    assert model.lm_head.weight is model.wte.weight
    biases = [m.bias for m in model.modules() if isinstance(m, torch.nn.Linear) and m.bias is not None]
    assert len(biases) == 2 * 2 * 2  # c_attn, c_proj, c_fc, c_proj per layer
    assert all(torch.equal(b, torch.zeros_like(b)) for b in biases)
    block = model.h[0]
    if norm == "layer":
        assert torch.equal(block.ln_1.weight, torch.ones(32)) and torch.equal(block.ln_1.bias, torch.zeros(32))
    else:
        assert block.ln_1.weight.item() == pytest.approx(math.sqrt(32))
    assert torch.equal(block.attn.q_norm, torch.ones(8))
    for p in model.parameters():
        assert torch.isfinite(p).all()


@pytest.mark.parametrize("name", sorted(INITS))
def test_every_matrix_is_reinitialised(name: str) -> None:
    """No Linear keeps PyTorch's default kaiming-uniform init (bounded by 1/sqrt(fan_in)); all are centred."""
    model = _model({"name": name}, tie_embeddings=False)
    for mod_name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            w = module.weight
            assert abs(w.mean().item()) < 0.1 * _std(w), mod_name
            # a Gaussian of that size has entries beyond 3 std; the uniform default never exceeds sqrt(3) std
            assert w.abs().max().item() > 2.5 * _std(w), mod_name


@pytest.mark.parametrize("name", sorted(INITS))
def test_reset_parameters_is_seeded(name: str) -> None:
    torch.manual_seed(3)
    a = _model({"name": name})
    torch.manual_seed(3)
    b = _model({"name": name})
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), n


def test_deepnorm_with_xavier_is_deepnet_and_gpt2_says_it_drops_beta(tiny_cfg) -> None:
    """One override gives the method: placement=deepnorm's β = (8L)^(-1/4) is applied by the Xavier inits (xavier and
    deepnet give the same weights), and an init that cannot apply it warns instead of silently dropping it."""
    import warnings

    from lmlab.model.gpt import GPT

    cfg = dict(n_layer=6, d_model=64, n_head=4, placement={"name": "deepnorm"}, norm={"name": "layer"})
    torch.manual_seed(0)
    a = GPT(tiny_cfg(**cfg, init={"name": "xavier"}))
    torch.manual_seed(0)
    b = GPT(tiny_cfg(**cfg, init={"name": "deepnet"}))
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
    beta = (8 * 6) ** -0.25
    proj = a.h[3].mlp.c_proj.weight  # an FFN output matrix: Xavier std sqrt(2 / (fan_in + fan_out)) times β
    expected = beta * math.sqrt(2 / sum(proj.shape))
    assert proj.std().item() == pytest.approx(expected, rel=0.1)
    q_rows = a.h[3].attn.c_attn.weight[:64]  # queries keep gain 1
    assert q_rows.std().item() == pytest.approx(math.sqrt(2 / (64 + 64)), rel=0.1)
    with pytest.warns(UserWarning, match=r"init=gpt2 does not apply the placement's init gain β=0\.3799 .*init=xavier"):
        GPT(tiny_cfg(**cfg, init={"name": "gpt2"}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GPT(tiny_cfg(**{**cfg, "placement": {"name": "pre"}}, init={"name": "gpt2"}))  # β = 1: nothing to say


# ---- the shared keys (conf/init_base/shared.yaml): the speedrun's zero and mimetic inits ----------------------


@pytest.mark.parametrize("scheme", sorted(INITS))
def test_zero_proj_and_zero_head_zero_exactly_the_stream_writers_and_the_head(scheme: str) -> None:
    """Records 5 and 8: every projection into the stream (attention's and the MLP's output) and the untied head are
    zero, so each block is the identity and the logits are 0 at step 0; the other matrices keep the scheme's draw."""
    model = _model({"name": scheme, "zero_proj": True, "zero_head": True}, tie_embeddings=False)
    for block in model.h:
        assert not block.attn.c_proj.weight.any() and not block.mlp.c_proj.weight.any()
        assert _std(block.attn.c_attn.weight) > 0.01 and _std(block.mlp.c_fc.weight) > 0.01
    assert not model.lm_head.weight.any() and _std(model.wte.weight) > 0.01
    idx = torch.randint(0, V, (2, 8))
    with torch.no_grad():
        assert not model(idx).any()


def test_mimetic_vo_makes_the_value_output_product_minus_beta_identity() -> None:
    """Record 64 (Trockman & Kolter, 2023): W_v = √β·I + ε, W_o = −√β·I + ε with ε ~ N(0, noise): W_o·W_v = −β·I up
    to the noise; q and k keep the scheme's draw; with zero_proj the MLP's output stays zero and attention's is
    mimetic's."""
    beta, noise = 0.05, 0.01
    model = _model({"name": "gpt2", "mimetic_vo": beta, "mimetic_noise": noise, "zero_proj": True})
    for block in model.h:
        attn = block.attn
        v = attn.c_attn.weight[2 * C:3 * C]
        product = attn.c_proj.weight @ v
        # off the diagonal: two noise terms of √β·ε each, std √(2β)·noise; the diagonal −β plus those
        torch.testing.assert_close(product.diagonal().mean().item(), -beta, rtol=0, atol=5e-3)
        assert _std(product - torch.diag(product.diagonal())) == pytest.approx((2 * beta) ** 0.5 * noise, rel=0.1)
        assert _std(v - beta ** 0.5 * torch.eye(C)) == pytest.approx(noise, rel=REL)
        assert _std(attn.c_attn.weight[:2 * C]) == pytest.approx(0.02, rel=REL)
        assert not block.mlp.c_proj.weight.any()


@pytest.mark.parametrize("kw,message", [
    ({"init": {"name": "gpt2", "zero_head": True}}, r"init.zero_head=true .* model.tie_embeddings=true"),
    ({"init": {"name": "gpt2", "mimetic_vo": 0.05}, "n_kv_head": 2, "attention": {"name": "gqa"}},
     r"init.mimetic_vo .* model.n_kv_head"),
    ({"init": {"name": "gpt2", "mimetic_vo": -1.0}}, r"init.mimetic_vo"),
])
def test_bad_shared_init_keys_are_named(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _model(**kw)
