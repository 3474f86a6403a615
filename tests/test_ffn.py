"""FFNs: MLP and GLU against their formulas computed by hand from the weights; pinned gates ignore `activation`;
the parameter-matching rule (GLU hidden = 2/3 of the MLP's, rounded) and GPTConfig.ffn_hidden."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab.config import GPTConfig
from lmlab.model.activation import Activation
from lmlab.model.ffn import FFNS, GLU
from lmlab.registry import build

D, H = 16, 24
GLUS = sorted(name for name, cls in FFNS.items() if issubclass(cls, GLU))
PINNED = {name: FFNS[name].gate for name in GLUS if FFNS[name].gate}
TOL = dict(rtol=1e-5, atol=1e-6)


def _ffn(name: str, activation: dict | None = None, bias: bool = True, hidden: int = H):
    return build("ffn", FFNS, {"name": name}, D, hidden, activation=activation or {"name": "gelu"}, bias=bias)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x @ w.T + (b if b is not None else 0)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("name", sorted(FFNS))
def test_shape_dtype_and_bias_flag(name: str, bias: bool) -> None:
    ffn = _ffn(name, bias=bias)
    x = torch.randn(2, 5, D)
    y = ffn(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    biases = [n for n, _ in ffn.named_parameters() if n.endswith("bias")]
    assert bool(biases) == bias
    assert 0 < FFNS[name].hidden_ratio <= 1


@pytest.mark.parametrize("act", ["relu", "gelu", "squareplus", "tanh"])
def test_mlp_formula(act: str) -> None:
    ffn = _ffn("mlp", {"name": act})
    x = torch.randn(2, 5, D)
    h = Activation({"name": act})(_linear(x, ffn.c_fc.weight, ffn.c_fc.bias))
    torch.testing.assert_close(ffn(x), _linear(h, ffn.c_proj.weight, ffn.c_proj.bias), **TOL)
    assert ffn.c_fc.weight.shape == (H, D) and ffn.c_proj.weight.shape == (D, H)


@pytest.mark.parametrize("name", GLUS)
def test_glu_formula_gate_is_first_half(name: str) -> None:
    act = {"name": "tanh"}
    ffn = _ffn(name, act)
    assert ffn.c_fc.weight.shape == (2 * H, D)
    x = torch.randn(2, 5, D)
    w, b = ffn.c_fc.weight, ffn.c_fc.bias
    gate = _linear(x, w[:H], b[:H])
    up = _linear(x, w[H:], b[H:])
    gate_fn = Activation({"name": PINNED.get(name) or act["name"]})
    expected = _linear(gate_fn(gate) * up, ffn.c_proj.weight, ffn.c_proj.bias)
    torch.testing.assert_close(ffn(x), expected, **TOL)
    # swapping the halves (up gated instead) gives something else: the test would see a wrong split
    swapped = _linear(gate_fn(up) * gate, ffn.c_proj.weight, ffn.c_proj.bias)
    assert not torch.allclose(ffn(x), swapped, atol=1e-3)


def test_glu_uses_the_activation_group() -> None:
    x = torch.randn(3, D)
    ffn = _ffn("glu", {"name": "squareplus", "b": 1.0})
    gate, up = _linear(x, ffn.c_fc.weight, ffn.c_fc.bias).chunk(2, dim=-1)
    expected = _linear(0.5 * (gate + torch.sqrt(gate**2 + 1.0)) * up, ffn.c_proj.weight, ffn.c_proj.bias)
    torch.testing.assert_close(ffn(x), expected, **TOL)


def test_pinned_gates_are_silu_gelu_relu() -> None:
    assert PINNED == {"swiglu": "silu", "geglu": "gelu", "reglu": "relu"}


@pytest.mark.parametrize("other", ["relu", "gelu", "tanh", "sigmoid"])
@pytest.mark.parametrize("name", sorted(PINNED))
def test_pinned_gate_ignores_activation(name: str, other: str) -> None:
    """swiglu with activation=relu still gates with silu (a functools.partial would let the keyword win)."""
    torch.manual_seed(1)
    pinned = _ffn(name, {"name": other})
    plain = _ffn("glu", {"name": PINNED[name]})
    plain.load_state_dict(pinned.state_dict())
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(pinned(x), plain(x), rtol=0, atol=0)
    if other != PINNED[name]:
        with_other = _ffn("glu", {"name": other})
        with_other.load_state_dict(pinned.state_dict())
        assert not torch.allclose(pinned(x), with_other(x), atol=1e-4)


def test_swiglu_matches_silu_by_hand() -> None:
    ffn = _ffn("swiglu", {"name": "relu"}, bias=False)
    x = torch.randn(4, D)
    gate, up = (x @ ffn.c_fc.weight.T).chunk(2, dim=-1)
    torch.testing.assert_close(ffn(x), (F.silu(gate) * up) @ ffn.c_proj.weight.T, **TOL)


def _n_params(m: torch.nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name", sorted(FFNS))
def test_parameter_matching(name: str) -> None:
    d, multiple_of = 192, 64
    spec = {"name": name, "hidden_mult": 4, "multiple_of": multiple_of}
    mlp_cfg = GPTConfig(vocab_size=50, d_model=d, n_head=4, ffn={**spec, "name": "mlp"})
    cfg = GPTConfig(vocab_size=50, d_model=d, n_head=4, ffn=spec)
    assert cfg.ffn_hidden % multiple_of == 0
    mlp = build("ffn", FFNS, mlp_cfg.ffn_spec, d, mlp_cfg.ffn_hidden, activation={"name": "gelu"})
    ffn = build("ffn", FFNS, cfg.ffn_spec, d, cfg.ffn_hidden, activation={"name": "gelu"})
    assert abs(_n_params(ffn) - _n_params(mlp)) <= 3 * d * multiple_of
    assert _n_params(mlp) == 2 * d * 4 * d


@pytest.mark.parametrize(("name", "d", "mult", "multiple_of", "hidden"), [
    ("mlp", 64, 4, 64, 256),
    ("mlp", 100, 4, 8, 400),
    ("glu", 192, 4, 64, 512),       # 2/3 · 768 = 512 exactly
    ("swiglu", 64, 4, 64, 192),     # 170.7 -> 3 · 64
    ("geglu", 128, 4, 64, 320),     # 341.3 -> 5 · 64
    ("reglu", 100, 4, 8, 264),      # 266.7 -> 33 · 8
    ("swiglu", 4096, 4, 256, 11008),  # Llama-7B: 10922.7 -> 43 · 256
    ("glu", 32, 1, 64, 64),         # 21.3 rounds to 0 multiples: at least one multiple
])
def test_ffn_hidden_values(name: str, d: int, mult: int, multiple_of: int, hidden: int) -> None:
    cfg = GPTConfig(vocab_size=50, d_model=d, n_head=4, ffn={"name": name, "hidden_mult": mult,
                                                             "multiple_of": multiple_of})
    assert cfg.ffn_hidden == hidden
    assert cfg.ffn_spec == {"name": name}


def test_ffn_spec_keys_are_checked() -> None:
    with pytest.raises(ValueError, match=r"ffn='mlp' does not take \['gate'\]"):
        GPTConfig(vocab_size=50, d_model=32, n_head=4, ffn={"name": "mlp", "gate": "silu"})
