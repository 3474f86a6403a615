"""Activations: values at fixed points against the formulas (computed here with `math`, not torch), squareplus's
b (default 4, ReLU as b -> 0), and `Activation` binding a spec's parameters."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.model.activation import ACTIVATIONS, Activation

POINTS = [-3.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.5]


def _gelu_tanh(x: float) -> float:
    return 0.5 * x * (1 + math.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


REFERENCE = {  # the formula each option must compute, with its default parameters
    "relu": lambda x: max(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1 + math.erf(x / math.sqrt(2))),
    "gelu_tanh": _gelu_tanh,
    "silu": lambda x: x / (1 + math.exp(-x)),
    "squareplus": lambda x: (x + math.sqrt(x * x + 4.0)) / 2,
    "relu2": lambda x: max(x, 0.0) ** 2,
    "leaky_relu": lambda x: x if x >= 0 else 0.01 * x,
    "sigmoid": lambda x: 1 / (1 + math.exp(-x)),
    "tanh": math.tanh,
}


def test_every_activation_has_a_reference_formula() -> None:
    assert set(REFERENCE) == set(ACTIVATIONS)  # a new activation is tested against its formula, not skipped


@pytest.mark.parametrize("name", sorted(REFERENCE))
def test_values_at_fixed_points(name: str) -> None:
    x = torch.tensor(POINTS, dtype=torch.float64)
    expected = torch.tensor([REFERENCE[name](v) for v in POINTS], dtype=torch.float64)
    torch.testing.assert_close(ACTIVATIONS[name](x), expected, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_elementwise_shape_dtype(name: str) -> None:
    """Pointwise: same shape and dtype, and each output depends only on its own input."""
    act = Activation({"name": name})
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(2, 3, 5).to(dtype)
        y = act(x)
        assert y.shape == x.shape and y.dtype == dtype and torch.isfinite(y).all()
    x = torch.randn(40)
    perm = torch.randperm(40)
    torch.testing.assert_close(act(x)[perm], act(x[perm]), rtol=1e-6, atol=1e-7)  # SIMD tails round differently


def test_gelu_is_erf_and_gelu_tanh_is_the_tanh_formula() -> None:
    x = torch.tensor([1.0], dtype=torch.float64)
    assert ACTIVATIONS["gelu"](x).item() == pytest.approx(0.8413447460685429, abs=1e-12)
    assert ACTIVATIONS["gelu_tanh"](x).item() == pytest.approx(0.8411919906082768, abs=1e-12)
    # the two differ by more than rounding: neither is the other in disguise
    grid = torch.linspace(-4, 4, 81, dtype=torch.float64)
    assert (ACTIVATIONS["gelu"](grid) - ACTIVATIONS["gelu_tanh"](grid)).abs().max() > 1e-4


def test_squareplus_default_b_and_limit() -> None:
    sp = ACTIVATIONS["squareplus"]
    assert sp(torch.tensor(0.0)).item() == pytest.approx(1.0)  # sqrt(4) / 2
    assert sp(torch.tensor(0.0), b=1.0).item() == pytest.approx(0.5)
    assert sp(torch.tensor(3.0), b=16.0).item() == pytest.approx((3 + 5) / 2)
    x = torch.linspace(-5, 5, 101, dtype=torch.float64)
    torch.testing.assert_close(sp(x, b=1e-12), torch.relu(x), rtol=0, atol=1e-6)
    gaps = [(sp(x, b=b) - torch.relu(x)).abs().max().item() for b in (4.0, 1.0, 0.01)]
    assert gaps[0] > gaps[1] > gaps[2]  # closer to ReLU as b shrinks (max gap sqrt(b)/2, at x = 0)
    assert gaps == pytest.approx([1.0, 0.5, 0.05], rel=1e-9)


def test_relu2_numbers() -> None:
    torch.testing.assert_close(ACTIVATIONS["relu2"](torch.tensor([-3.0, 0.0, 3.0])), torch.tensor([0.0, 0.0, 9.0]),
                               rtol=0, atol=0)


def test_leaky_relu_slope() -> None:
    x = torch.tensor([-2.0, 2.0])
    torch.testing.assert_close(ACTIVATIONS["leaky_relu"](x), torch.tensor([-0.02, 2.0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(ACTIVATIONS["leaky_relu"](x, negative_slope=0.25), torch.tensor([-0.5, 2.0]),
                               rtol=1e-6, atol=0)


def test_activation_binds_spec_params() -> None:
    sp = Activation({"name": "squareplus", "b": 1.0})
    assert sp.name == "squareplus" and sp.params == {"b": 1.0}
    assert sp(torch.tensor(0.0)).item() == pytest.approx(0.5)
    leaky = Activation({"name": "leaky_relu", "negative_slope": 0.2})
    assert leaky(torch.tensor(-1.0)).item() == pytest.approx(-0.2)
    assert "negative_slope=0.2" in repr(leaky)


def test_activation_rejects_unknown_key_and_name() -> None:
    with pytest.raises(ValueError, match=r"activation='relu' does not take \['b'\]"):
        Activation({"name": "relu", "b": 1.0})
    with pytest.raises(ValueError, match=r"activation='swish'.*'gelu'"):
        Activation({"name": "swish"})
