"""Position schemes: the hook contract for every option; RoPE's relative-position property, norm preservation,
partial rotary and its use of the scaling options; the sinusoidal table; the learned table's limit; ALiBi's slopes
and bias; and validate()'s errors for RoPE-only settings."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.gpt import validate
from lmlab.model.position import POSITIONS, alibi_slopes
from lmlab.model.resolve import resolve
from lmlab.registry import build

D, NH, HS, L = 32, 4, 8, 16
NONE = {"name": "none"}


def _pos(name: str, scaling: dict = NONE, head_dim: int = HS, max_seq_len: int = L, train_len: int = L, **params):
    return build("position", POSITIONS, {"name": name, **params}, D, head_dim, NH, max_seq_len, train_len, scaling)


# ---- the contract, for every option ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POSITIONS))
def test_hooks_keep_shapes_and_bias_is_causal(name: str) -> None:
    pos = _pos(name)
    x = torch.randn(2, 10, D)
    assert pos.embed(x).shape == x.shape
    q, k = torch.randn(2, NH, 10, HS), torch.randn(2, NH, 10, HS)
    rq, rk = pos.rotate(q, k)
    assert rq.shape == q.shape and rk.shape == k.shape
    bias = pos.attn_bias(10, x.device, x.dtype)
    if bias is not None:
        assert bias.shape == (NH, 10, 10)
        upper = torch.ones(10, 10, dtype=torch.bool).triu(1)
        assert torch.isneginf(bias[:, upper]).all()
        assert torch.isfinite(bias[:, ~upper]).all()
        if name == "alibi":  # no bias on the diagonal (T5's and FIRE's there are learned)
            assert torch.equal(bias[:, range(10), range(10)], torch.zeros(NH, 10))


@pytest.mark.parametrize("name", sorted(POSITIONS))
def test_scaling_option_needs_a_scheme_that_accepts_it(name: str) -> None:
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=1, d_model=D, n_head=NH, max_seq_len=L, position={"name": name},
                    rope_scaling={"name": "linear", "factor": 2.0}))
    if POSITIONS[name].accepts_scaling:
        assert validate(cfg) is cfg
    else:
        with pytest.raises(ValueError, match=rf"rope_scaling='linear' needs position=rope.*position='{name}'"):
            validate(cfg)


def test_only_rope_accepts_scaling() -> None:
    assert {n for n, cls in POSITIONS.items() if cls.accepts_scaling} == {"rope"}


def test_nope_hooks_are_identity() -> None:
    pos = _pos("none")
    x, q, k = torch.randn(2, 5, D), torch.randn(2, NH, 5, HS), torch.randn(2, NH, 5, HS)
    assert torch.equal(pos.embed(x), x)
    rq, rk = pos.rotate(q, k)
    assert torch.equal(rq, q) and torch.equal(rk, k)
    assert pos.attn_bias(5, x.device, x.dtype) is None


# ---- RoPE -----------------------------------------------------------------------------------------------------


def _rotate_same_vector(pos, q: torch.Tensor, k: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Place the same q and the same k at every position 0..T-1 and rotate: (T, hs) each."""
    Q = q.expand(1, 1, T, q.numel()).contiguous()
    K = k.expand(1, 1, T, k.numel()).contiguous()
    rq, rk = pos.rotate(Q, K)
    return rq[0, 0], rk[0, 0]


@pytest.mark.parametrize("theta", [10000.0, 100.0])
def test_rope_dot_product_depends_only_on_offset(theta: float) -> None:
    T = 12
    pos = _pos("rope", theta=theta)
    q, k = torch.randn(HS, dtype=torch.float64), torch.randn(HS, dtype=torch.float64)
    rq, rk = _rotate_same_vector(pos, q, k, T)
    dots = rq @ rk.T  # dots[m, n] = <R_m q, R_n k>
    for offset in range(-(T - 1), T):
        diag = torch.diagonal(dots, offset=-offset)  # entries with m - n = offset
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-5, atol=1e-6)  # float32 tables
    along = torch.stack([torch.diagonal(dots, offset=-o)[0] for o in range(T)])
    assert along.std() > 1e-3  # and it does depend on the offset


def test_rope_preserves_norms_and_leaves_position_zero() -> None:
    pos = _pos("rope")
    q, k = torch.randn(2, NH, 10, HS), torch.randn(2, NH, 10, HS)
    rq, rk = pos.rotate(q, k)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rk.norm(dim=-1), k.norm(dim=-1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rq[:, :, 0], q[:, :, 0], rtol=0, atol=0)


def test_rope_formula_half_split() -> None:
    """x'_j = x_j cos(t θ_j) − x_{j+d/2} sin(t θ_j), x'_{j+d/2} = x_{j+d/2} cos + x_j sin, θ_j = theta^(−2j/d)."""
    theta, T = 100.0, 5
    pos = _pos("rope", theta=theta)
    x = torch.randn(1, 1, T, HS, dtype=torch.float64)
    rx, _ = pos.rotate(x, x)
    half = HS // 2
    expected = torch.empty_like(x)
    for t in range(T):
        for j in range(half):
            a = t * theta ** (-2 * j / HS)
            x1, x2 = x[0, 0, t, j].item(), x[0, 0, t, j + half].item()
            expected[0, 0, t, j] = x1 * math.cos(a) - x2 * math.sin(a)
            expected[0, 0, t, j + half] = x2 * math.cos(a) + x1 * math.sin(a)
    torch.testing.assert_close(rx, expected, rtol=1e-6, atol=1e-6)  # the frequencies are float32


def test_rope_partial_rotary_leaves_tail_untouched() -> None:
    head_dim = 16
    pos = _pos("rope", head_dim=head_dim, rotary_pct=0.5)
    assert pos.rot_dim == 8 and pos.inv_freq.numel() == 4
    q, k = torch.randn(2, NH, 10, head_dim), torch.randn(2, NH, 10, head_dim)
    rq, rk = pos.rotate(q, k)
    assert torch.equal(rq[..., 8:], q[..., 8:]) and torch.equal(rk[..., 8:], k[..., 8:])
    assert not torch.allclose(rq[..., 1:, :8], q[..., 1:, :8])
    full = _pos("rope", head_dim=8)  # the rotated part is exactly RoPE on an 8-dim head
    fq, _ = full.rotate(q[..., :8].contiguous(), k[..., :8].contiguous())
    torch.testing.assert_close(rq[..., :8], fq, rtol=0, atol=0)


def test_odd_head_dim_with_rope_fails_in_validate() -> None:
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=1, d_model=30, n_head=6, position={"name": "rope"}))  # head_dim 5
    with pytest.raises(ValueError, match=r"position=rope.*model\.d_model / model\.n_head.*5 is odd"):
        validate(cfg)


def test_rotary_dim_below_two_fails_in_validate() -> None:
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=1, d_model=32, n_head=4,
                            position={"name": "rope", "rotary_pct": 0.2}))
    with pytest.raises(ValueError, match=r"position\.rotary_pct"):
        validate(cfg)


@pytest.mark.parametrize("name", sorted(n for n in POSITIONS if n not in ("rope", "xpos")))  # xpos: its own test
def test_odd_head_dim_is_fine_without_rope(name: str) -> None:
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=1, d_model=30, n_head=6, position={"name": name}))
    assert validate(cfg) is cfg


def test_rope_linear_scaling_divides_positions() -> None:
    """Position interpolation through RoPE: position 2t with factor 2 is rotated like position t without it."""
    plain = _pos("rope")
    scaled = _pos("rope", {"name": "linear", "factor": 2.0, "original_max_len": L}, max_seq_len=2 * L)
    cos_p, sin_p = plain.cos_sin(L, torch.device("cpu"), torch.float32)
    cos_s, sin_s = scaled.cos_sin(2 * L, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(cos_s[0::2], cos_p, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sin_s[0::2], sin_p, rtol=1e-5, atol=1e-6)


def test_rope_attention_factor_multiplies_cos_and_sin() -> None:
    pos = _pos("rope", {"name": "yarn", "factor": 4.0, "original_max_len": L}, max_seq_len=4 * L)
    assert pos.attention_factor == pytest.approx(0.1 * math.log(4.0) + 1)
    cos, sin = pos.cos_sin(20, torch.device("cpu"), torch.float32)
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, pos.attention_factor**2), rtol=1e-5, atol=1e-6)


def test_rope_dynamic_scaling_recomputed_per_length() -> None:
    pos = _pos("rope", {"name": "dynamic_ntk", "factor": 1.0, "original_max_len": L}, max_seq_len=4 * L)
    plain = _pos("rope", max_seq_len=4 * L)
    cpu, f32 = torch.device("cpu"), torch.float32
    assert pos.dynamic
    torch.testing.assert_close(pos.cos_sin(L, cpu, f32)[0], plain.cos_sin(L, cpu, f32)[0], rtol=0, atol=0)
    long, long_plain = pos.cos_sin(4 * L, cpu, f32)[0], plain.cos_sin(4 * L, cpu, f32)[0]
    assert not torch.allclose(long[:L], long_plain[:L])  # past L the frequencies change, also for early positions


def test_rope_tables_from_inference_mode_are_usable_in_training() -> None:
    pos = _pos("rope")
    q = torch.randn(1, NH, 6, HS, requires_grad=True)
    with torch.inference_mode():
        pos.rotate(q.detach(), q.detach())
    rq, _ = pos.rotate(q, q)
    rq.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


# ---- sinusoidal ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("base", [10000.0, 500.0])
def test_sinusoidal_table_values(base: float) -> None:
    pos = _pos("sinusoidal", base=base)
    T = 9
    table = pos.table(T, torch.device("cpu"))
    assert table.shape == (T, D)
    expected = torch.empty(T, D, dtype=torch.float64)
    for t in range(T):
        for i in range(D // 2):
            angle = t / base ** (2 * i / D)
            expected[t, 2 * i], expected[t, 2 * i + 1] = math.sin(angle), math.cos(angle)
    torch.testing.assert_close(table.double(), expected, rtol=0, atol=2e-6)
    x = torch.randn(2, T, D)
    torch.testing.assert_close(pos.embed(x), x + table, rtol=0, atol=0)


def test_sinusoidal_has_no_parameters() -> None:
    assert sum(p.numel() for p in _pos("sinusoidal").parameters()) == 0


# ---- learned -------------------------------------------------------------------------------------------------


def test_learned_adds_its_table() -> None:
    pos = _pos("learned")
    assert pos.wpe.weight.shape == (L, D)
    x = torch.randn(2, 10, D)
    torch.testing.assert_close(pos.embed(x), x + pos.wpe.weight[:10], rtol=0, atol=0)


def test_learned_raises_past_max_seq_len() -> None:
    pos = _pos("learned")
    assert pos.embed(torch.randn(1, L, D)).shape == (1, L, D)
    with pytest.raises(ValueError, match=rf"position=learned has a table of {L} positions \(model\.max_seq_len\)"
                                         rf".* {L + 1}"):
        pos.embed(torch.randn(1, L + 1, D))


# ---- ALiBi ---------------------------------------------------------------------------------------------------


def test_alibi_slopes_power_of_two() -> None:
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0**-i for i in range(1, 9)]), rtol=0, atol=0)
    torch.testing.assert_close(alibi_slopes(4), torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]), rtol=0, atol=0)
    torch.testing.assert_close(alibi_slopes(16)[:2], torch.tensor([2.0**-0.5, 2.0**-1]), rtol=1e-7, atol=0)


def test_alibi_slopes_non_power_of_two() -> None:
    """Press et al.'s code: the 4-head slopes, then every other slope of the 8-head sequence (2^-1, 2^-3)."""
    expected = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]
    torch.testing.assert_close(alibi_slopes(6), torch.tensor(expected), rtol=0, atol=0)
    expected12 = [2.0**-i for i in range(1, 9)] + [2.0**-0.5, 2.0**-1.5, 2.0**-2.5, 2.0**-3.5]
    torch.testing.assert_close(alibi_slopes(12), torch.tensor(expected12), rtol=1e-7, atol=0)


def test_alibi_bias_values() -> None:
    pos = _pos("alibi")
    T = 6
    bias = pos.attn_bias(T, torch.device("cpu"), torch.float32)
    slopes = [2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8]
    for h in range(NH):
        for i in range(T):
            for j in range(T):
                if j <= i:
                    assert bias[h, i, j].item() == pytest.approx(-slopes[h] * (i - j))
                else:
                    assert bias[h, i, j].item() == float("-inf")


def test_alibi_has_no_embedding() -> None:
    pos = _pos("alibi")
    x = torch.randn(2, 5, D)
    assert torch.equal(pos.embed(x), x)
    assert sum(p.numel() for p in pos.parameters()) == 0
