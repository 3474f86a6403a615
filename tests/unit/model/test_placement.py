"""Placements: each block's forward against SPEC's formula, with the attention and FFN sublayers (or block=gau's one
sublayer) replaced by known functions (zero, identity, and a nonlinear one) and the block's own norms (with distinct,
non-trivial weights);
`final_norm` and the model's ln_f; DeepNorm's α = (2L)^(1/4) and init gain β = (8L)^(-1/4)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.model.norm import NoNorm
from lmlab.model.placement import PLACEMENTS
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.registry import build

# placement=deepnorm is built here under the default init=gpt2, which says once per model that it leaves out
# DeepNet's init gain β (lmlab.model.init; tests/unit/model/test_init.py checks that warning): expected, not shown
pytestmark = pytest.mark.filterwarnings("ignore:init=gpt2 does not apply the placement's init gain")

D, N_LAYER = 16, 3
TOL = dict(rtol=1e-5, atol=1e-6)


class Sub(nn.Module):
    """A stand-in sublayer computing a known function; the attention one accepts (x, pos, cache)."""

    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x: torch.Tensor, pos=None, cache=None) -> torch.Tensor:
        return self.fn(x)


SUBLAYERS = {
    "zero": (lambda x: torch.zeros_like(x), lambda x: torch.zeros_like(x)),
    "identity": (lambda x: x, lambda x: x),
    "nonlinear": (lambda x: torch.tanh(2 * x) + 0.5, lambda x: 0.3 * x**2 - 1.0),
}


def _step(name: str, b: nn.Module, F, x: torch.Tensor, j: int) -> torch.Tensor:
    """SPEC's residual wiring of sublayer j, with N = the block's own norm modules ln_j (and ln_j_post)."""
    N = getattr(b, f"ln_{j}")
    if name == "pre":  # x + F(N(x))
        return x + F(N(x))
    if name == "post":  # N(x + F(x))
        return N(x + F(x))
    if name == "double":  # x + N(F(N(x)))
        return x + getattr(b, f"ln_{j}_post")(F(N(x)))
    if name == "post_nonres":  # x + N(F(x))
        return x + N(F(x))
    if name == "deepnorm":  # N(αx + F(x)), α = (2L)^(1/4)
        return N((2 * N_LAYER) ** 0.25 * x + F(x))
    pytest.fail(f"placement {name!r} has no SPEC formula in tests/unit/model/test_placement.py: add it to _step")


def _formula(name: str, b: nn.Module, A, M, x: torch.Tensor) -> torch.Tensor:
    """A transformer layer: the attention step, then the FFN step."""
    return _step(name, b, M, _step(name, b, A, x, 1), 2)


def _block(name: str, norm: str = "layer", block: str = "transformer") -> nn.Module:
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=N_LAYER, d_model=D, n_head=2, norm={"name": norm},
                    placement={"name": name}, block={"name": block}))
    block = build("placement", PLACEMENTS, cfg.placement, cfg, 1)
    with torch.no_grad():  # distinct affine parameters per norm, so swapped norms are caught
        for p in block.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + 1.0)
    return block.eval()


@pytest.mark.parametrize("norm", ["layer", "rms"])
@pytest.mark.parametrize("sub", sorted(SUBLAYERS))
@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_block_formula(name: str, sub: str, norm: str) -> None:
    block = _block(name, norm)
    A, M = SUBLAYERS[sub]
    block.attn, block.mlp = Sub(A), Sub(M)
    x = torch.randn(2, 5, D) * 2 + 0.5
    torch.testing.assert_close(block(x, None), _formula(name, block, A, M, x), **TOL)


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_block_formula_with_real_sublayers(name: str) -> None:
    """The real attention and FFN, wrapped: the block calls each once with the formula's input."""
    block = _block(name)
    pos = build("position", POSITIONS, {"name": "rope"}, D, D // 2, 2, 16, 16, {"name": "none"})
    attn, mlp = block.attn, block.mlp
    x = torch.randn(2, 5, D)
    expected = _formula(name, block, lambda h: attn(h, pos), mlp, x)
    torch.testing.assert_close(block(x, pos), expected, **TOL)


@pytest.mark.parametrize("sub", sorted(SUBLAYERS))
@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_gau_block_is_one_step(name: str, sub: str) -> None:
    """block=gau: one sublayer, wired by the same placement with its own norm ln_1 (and ln_1_post)."""
    block = _block(name, "rms", block="gau")
    assert block.sublayer_names == ("gau",) and not hasattr(block, "ln_2") and not hasattr(block, "attn")
    G = SUBLAYERS[sub][0]
    block.gau = Sub(G)
    x = torch.randn(2, 5, D) * 2 + 0.5
    torch.testing.assert_close(block(x, None), _step(name, block, G, x, 1), **TOL)


def test_zero_sublayers_pre_and_double_are_identity() -> None:
    """With F = 0 the identity path is all that is left (RMSNorm maps 0 to 0, so double adds nothing either)."""
    for name in ("pre", "double"):
        block = _block(name, "rms")
        block.attn, block.mlp = Sub(SUBLAYERS["zero"][0]), Sub(SUBLAYERS["zero"][1])
        x = torch.randn(2, 5, D)
        assert torch.equal(block(x, None), x)


EXPECTED_FINAL_NORM = {"pre": True, "post": False, "double": True, "post_nonres": True, "deepnorm": False}


@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_final_norm_flag(name: str) -> None:
    """Placements whose blocks end with a norm (post, deepnorm) need no final norm; the others do."""
    assert set(EXPECTED_FINAL_NORM) == set(PLACEMENTS)  # a new placement states its expectation here
    assert PLACEMENTS[name].final_norm is EXPECTED_FINAL_NORM[name]


@pytest.mark.parametrize("norm", ["rms", "layer"])
@pytest.mark.parametrize("name", sorted(PLACEMENTS))
def test_model_ln_f_follows_final_norm(name: str, norm: str) -> None:
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=D, n_head=2, norm={"name": norm},
                            placement={"name": name}))
    model = GPT(cfg)
    assert isinstance(model.ln_f, NoNorm) == (not PLACEMENTS[name].final_norm)
    n_ln_f = sum(p.numel() for p in model.ln_f.parameters())
    assert n_ln_f == (0 if not PLACEMENTS[name].final_norm else (D if norm == "rms" else 2 * D))


def test_double_has_post_norms() -> None:
    block = _block("double")
    assert isinstance(block.ln_1_post, nn.Module) and isinstance(block.ln_2_post, nn.Module)
    for name in sorted(set(PLACEMENTS) - {"double"}):
        assert not hasattr(_block(name), "ln_1_post")


@pytest.mark.parametrize("n_layer", [1, 2, 6, 24, 100])
def test_deepnorm_constants(n_layer: int) -> None:
    deepnorm = PLACEMENTS["deepnorm"]
    assert deepnorm.init_gain(n_layer) == pytest.approx((8 * n_layer) ** -0.25, rel=1e-12)
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=n_layer, d_model=D, n_head=2, placement={"name": "deepnorm"}))
    assert deepnorm(cfg, 0).alpha == pytest.approx((2 * n_layer) ** 0.25, rel=1e-12)


def test_deepnorm_numbers() -> None:
    assert PLACEMENTS["deepnorm"].init_gain(2) == pytest.approx(0.5)  # (16)^(-1/4)
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=8, d_model=D, n_head=2, placement={"name": "deepnorm"}))
    assert PLACEMENTS["deepnorm"](cfg, 0).alpha == pytest.approx(2.0)  # (16)^(1/4)


@pytest.mark.parametrize("name", sorted(set(PLACEMENTS) - {"deepnorm"}))
def test_other_placements_have_unit_init_gain(name: str) -> None:
    assert PLACEMENTS[name].init_gain(12) == 1.0
