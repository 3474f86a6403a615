"""The GAU block: its output against the formula written out with explicit matmuls, for every score; the parameter
count by formula; the init markers (DeepNet's gain on u, v and W_o, not on z); the monitor's groups; tiny_gau's
parameter count against tiny's."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from lmlab import CONF_DIR, compose
from lmlab.config import GPTConfig
from lmlab.model.attention.score import SCORES
from lmlab.model.gau import GAU
from lmlab.model.gpt import GPT
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.registry import build
from lmlab.run.monitor import layer_groups

D, S, E, T = 8, 4, 12, 6


def _gau(score: str, bias: bool = True, train_len: int = 4) -> GAU:
    torch.manual_seed(0)
    gau = GAU(D, S, E, score=score, activation={"name": "silu"}, bias=bias, train_len=train_len)
    with torch.no_grad():
        for name, p in gau.named_parameters():  # γ around 1, everything else around 0
            p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "gamma" in name else 0.0))
    return gau.eval()


def _direct(gau: GAU, x: torch.Tensor, score: str, train_len: int = 4) -> torch.Tensor:
    """O = (U ⊙ A V) W_o with U = φ(X W_u + b_u), V = φ(X W_v + b_v), Z = φ(X W_z + b_z), Q = Z γ_q + β_q,
    K = Z γ_k + β_k, logits = Q Kᵀ / √s, A by the score (n_i = i + 1 keys for query i), φ = SiLU."""
    W, b = gau.c_fc.weight, gau.c_fc.bias
    Wu, Wv, Wz = W[:E], W[E:2 * E], W[2 * E:]
    bu, bv, bz = b[:E], b[E:2 * E], b[2 * E:]
    U, V, Z = F.silu(x @ Wu.T + bu), F.silu(x @ Wv.T + bv), F.silu(x @ Wz.T + bz)  # (B, T, e|e|s)
    Q, K = Z * gau.q_gamma + gau.q_beta, Z * gau.k_gamma + gau.k_beta
    logits = Q @ K.transpose(-2, -1) / math.sqrt(S)  # (B, T, T)
    n = torch.arange(1.0, T + 1)[:, None]  # keys read by each query
    future = torch.ones(T, T, dtype=torch.bool).triu(1)
    if score == "relu2":
        A = (torch.relu(logits) ** 2 / n).masked_fill(future, 0.0)
    else:
        factor = torch.log(n) / math.log(train_len) if score == "softmax_plus" else torch.ones(T, 1)
        A = torch.softmax((logits * factor).masked_fill(future, float("-inf")), dim=-1)
    return (U * (A @ V)) @ gau.c_proj.weight.T + gau.c_proj.bias


@pytest.mark.parametrize("score", sorted(SCORES))
def test_gau_output_is_the_formula(score: str) -> None:
    gau = _gau(score)
    pos = build("position", POSITIONS, {"name": "none"}, D, S, 1, 16, 4, {"name": "none"})
    x = torch.randn(2, T, D)
    torch.testing.assert_close(gau(x, pos), _direct(gau, x, score), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
def test_gau_param_count(bias: bool) -> None:
    """d·s + 2·d·e + e·d + 4s, plus 2e + s + d biases."""
    gau = GAU(D, S, E, score="relu2", activation={"name": "silu"}, bias=bias, train_len=8)
    expected = D * S + 2 * D * E + E * D + 4 * S + (bias and 2 * E + S + D)
    assert sum(p.numel() for p in gau.parameters()) == expected == (372 if bias else 336)


def test_gau_model_param_count() -> None:
    """The whole model: embeddings + per layer (GAU, e = 2d, + one norm) + final norm."""
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=3, d_model=32, n_head=4, norm={"name": "rms"},
                    block={"name": "gau", "s": 16, "expansion": 2.0}))
    d, s, e = 32, 16, 64
    assert GPT(cfg).num_params() == 50 * d + 3 * (d * s + 3 * d * e + 4 * s + d) + d


def test_deepnet_scales_u_v_and_the_output_not_z() -> None:
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=8, d_model=64, n_head=4, placement={"name": "deepnorm"},
                    init={"name": "deepnet"}, block={"name": "gau", "s": 32, "expansion": 2.0}))
    gau = GPT(cfg).h[0].gau
    beta, d, e = (8 * 8) ** -0.25, 64, 128
    W = gau.c_fc.weight
    for rows, gain in ((W[:e], beta), (W[e:2 * e], beta), (W[2 * e:], 1.0)):
        fan_out = rows.shape[0]
        assert rows.std().item() == pytest.approx(gain * math.sqrt(2 / (d + fan_out)), rel=0.1)
    assert gau.c_proj.weight.std().item() == pytest.approx(beta * math.sqrt(2 / (e + d)), rel=0.1)


def test_monitor_groups_by_sublayer_name() -> None:
    gau = GPT(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, block={"name": "gau", "s": 16}))
    groups = layer_groups(gau)
    assert {k for k in groups if k.startswith("layer_00")} == {"layer_00/gau", "layer_00/norm"}
    assert len(groups["layer_00/gau"]) == 6  # c_fc and c_proj weights (no bias), γ_q, β_q, γ_k, β_k
    tf = layer_groups(GPT(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4)))
    assert {k for k in tf if k.startswith("layer_01")} == {"layer_01/attn", "layer_01/ffn", "layer_01/norm"}


def _params(model: str, block: str) -> int:
    sizes = OmegaConf.to_container(compose([f"model={model}"]).model)  # its YAML and conf/model_base
    spec = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "block" / f"{block}.yaml"))
    with torch.device("meta"):
        return GPT(GPTConfig(**{**sizes, "vocab_size": 65}, block=spec)).num_params()


def test_tiny_gau_matches_tiny() -> None:
    transformer, gau = _params("tiny", "transformer"), _params("tiny_gau", "gau")
    assert abs(gau - transformer) / transformer < 0.10


def test_gpt2_init_scales_by_the_number_of_residual_writes() -> None:
    """GPT-2's residual projections: 1/√N with N = sublayers writing into the stream: L for GAU (2L for attn + FFN)."""
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=8, d_model=64, n_head=4, block={"name": "gau", "s": 32}))
    gau = GPT(cfg).h[0].gau
    assert gau.c_proj.weight.std().item() == pytest.approx(0.02 / math.sqrt(8), rel=0.05)
    assert gau.c_fc.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_the_groups_a_gau_does_not_read_are_recorded_as_unused_not_validated() -> None:
    """block=gau replaces attention + FFN: a bad ffn or attention value is not refused for it (it is for a transformer
    layer), and the record says which groups did not apply."""
    bad = dict(ffn={"name": "mlp", "hidden_mult": 0}, attention={"name": "gqa"})  # gqa without n_kv_head: refused
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, block={"name": "gau", "s": 8}, **bad))
    assert cfg.unused == ["attention", "ffn"] and cfg.ffn_hidden == 0 and cfg.kv_heads == 0
    assert cfg.to_dict()["unused"] == ["attention", "ffn"]  # saved with the record
    with pytest.raises(ValueError, match="attention=gqa needs model.n_kv_head"):
        resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, **bad))
    assert resolve(GPTConfig(vocab_size=50, n_head=4)).unused == []


def _gau_out_over_in(score: str, qk_init: str) -> list[float]:
    """‖GAU(x)‖ / ‖x‖ of every layer at init (post placement, Xavier: gau_depth's setting) on random tokens."""
    from lmlab.config import GPTConfig
    from lmlab.model.gpt import GPT

    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=4, d_model=64, n_head=4, max_seq_len=64, vocab_size=100, position={"name": "rope"},
                    block={"name": "gau", "score": score, "qk_init": qk_init}, placement={"name": "post"},
                    init={"name": "xavier"})
    model, ratios = GPT(cfg).eval(), []
    for mod in model.modules():
        if getattr(mod, "sublayer", None) == "gau":
            mod.register_forward_hook(lambda m, inp, out: ratios.append((out.norm() / inp[0].norm()).item()))
    with torch.no_grad():
        model(torch.randint(0, 100, (4, 64)))
    return ratios


def test_flash_qk_init_makes_gau_tiny_at_init_with_relu2_only() -> None:
    """The source note: GAU(x) is ~two orders of magnitude smaller than x at init. With FLASH's γ ~ N(0, 0.02) and
    relu²/n it is ~1e-8 of x (scores ~(0.02²)² of lmlab's); with lmlab's γ = 1 it is 1e-5..0.8. Under softmax-like
    scores the small logits give near-uniform weights, so the output is V's mean either way (~0.18 of x)."""
    ones, flash = _gau_out_over_in("relu2", "ones"), _gau_out_over_in("relu2", "flash")
    assert max(flash) < 1e-6 < 0.1 < max(ones)
    for score in ("softmax_plus", "softmax"):
        a, b = max(_gau_out_over_in(score, "ones")), max(_gau_out_over_in(score, "flash"))
        assert 0.1 < b < a < 1.5 * b  # within 1.5x: no two orders of magnitude here
    gau = GAU(D, S, E, score="relu2", activation={"name": "silu"}, bias=False, train_len=8, qk_init="flash")
    assert gau.q_gamma.std().item() == pytest.approx(0.02, rel=0.5) and not gau.q_beta.any()
    assert torch.equal(GAU(D, S, E, score="relu2", activation={"name": "silu"}, bias=False, train_len=8).k_gamma,
                       torch.ones(S))  # the default: γ = 1, today's numbers


@pytest.mark.parametrize("key, value", [("doc_mask", True), ("window", 8), ("softcap", 30.0), ("sinks", True),
                                        ("gate", "headwise"), ("qk_norm", True), ("score", "relu2")])
def test_an_attention_behaviour_a_gau_would_not_honour_is_refused_by_key(key: str, value: object) -> None:
    """A GAU attends with its own unit (block.score, one head): an attention key every option takes, set away from its
    default, would do nothing under block=gau (a document mask that masks nothing), so it is refused naming it; the
    transformer takes it."""
    attention = {"name": "mha", key: value}
    with pytest.raises(ValueError, match=rf"attention\.{key}={value}: block=gau has no attention sublayer"):
        resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, block={"name": "gau", "s": 8},
                          attention=attention, eod_id=0))
    resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, attention=attention, eod_id=0))
