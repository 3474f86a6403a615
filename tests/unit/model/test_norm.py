"""Norms: every option keeps shape and dtype; each matches its formula with numbers; batch norm mixes positions
(and examples) in training, which leaks the future into the past, while the per-token norms don't."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.model.norm import NORMS
from lmlab.registry import build

B, T, C = 3, 5, 8
TOL = dict(rtol=1e-5, atol=1e-6)


def _norm(name: str, dim: int = C, **params):
    return build("norm", NORMS, {"name": name, **params}, dim)


def _randomise_affine(norm: torch.nn.Module) -> None:
    """Non-trivial affine parameters, so a formula that forgets w or b fails."""
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn_like(p) * 0.5 + 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(NORMS))
def test_shape_and_dtype_kept(name: str, dtype: torch.dtype) -> None:
    norm = _norm(name).to(dtype)
    for shape in [(B, T, C), (B * T, C)]:
        x = torch.randn(shape, dtype=dtype) * 3 + 1
        y = norm(x)
        assert y.shape == x.shape and y.dtype == dtype
        assert torch.isfinite(y).all()


def test_layer_norm_formula() -> None:
    norm = _norm("layer", eps=0.1)
    _randomise_affine(norm)
    assert norm.bias is not None and not torch.allclose(norm.bias, torch.zeros(C))
    x = torch.randn(B, T, C) * 2 + 3
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased
    expected = (x - mean) / torch.sqrt(var + 0.1) * norm.weight + norm.bias
    torch.testing.assert_close(norm(x), expected, **TOL)


def test_layer_norm_numbers() -> None:
    norm = _norm("layer", dim=4, eps=0.0)
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])  # mean 2.5, var 1.25
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(1.25)
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)


def test_layer_norm_without_bias_or_affine() -> None:
    assert _norm("layer", bias=False).bias is None
    plain = _norm("layer", affine=False)
    assert sum(p.numel() for p in plain.parameters()) == 0
    x = torch.randn(B, T, C)
    torch.testing.assert_close(plain(x), (x - x.mean(-1, keepdim=True)) / torch.sqrt(
        x.var(-1, unbiased=False, keepdim=True) + 1e-5), **TOL)


def test_rms_norm_formula() -> None:
    norm = _norm("rms", eps=0.1)
    _randomise_affine(norm)
    x = torch.randn(B, T, C) * 2 + 3
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 0.1) * norm.weight
    torch.testing.assert_close(norm(x), expected, **TOL)
    assert sum(p.numel() for p in norm.parameters()) == C  # no bias, no centring


@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_cpu_backward_is_the_exact_gradient(affine: bool) -> None:
    """The CPU path's hand-written backward against numerical differentiation in float64 (gradcheck), and against
    autograd through F.rms_norm in float32: outputs and gradients of x and w."""
    from lmlab.model.norm import _RMSNormFn

    torch.manual_seed(0)
    x = (torch.randn(2, 3, 6, dtype=torch.float64) * 2 + 1).requires_grad_()
    w = (torch.rand(6, dtype=torch.float64) + 0.5).requires_grad_() if affine else None
    assert torch.autograd.gradcheck(lambda x, w: _RMSNormFn.apply(x, w, 1e-3), (x, w))
    norm = _norm("rms", eps=1e-5, affine=affine)
    if affine:
        _randomise_affine(norm)
    x = (torch.randn(B, T, C) * 3).requires_grad_()
    g = torch.randn(B, T, C)
    ours = norm(x)
    ours.backward(g)
    grads = [x.grad.clone()] + ([norm.weight.grad.clone()] if affine else [])
    x.grad = None
    w_ref = norm.weight.detach().clone().requires_grad_() if affine else None
    ref = F.rms_norm(x, (C,), w_ref, 1e-5)
    ref.backward(g)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[0], x.grad, rtol=1e-5, atol=1e-5)
    if affine:
        torch.testing.assert_close(grads[1], w_ref.grad, rtol=1e-5, atol=1e-5)


def test_rms_norm_cpu_path_keeps_bf16_and_computes_in_fp32() -> None:
    """bf16 in, bf16 out (the norm contract), with the statistics taken in fp32: equal to F.rms_norm on the
    fp32 copy, rounded once."""
    norm = _norm("rms", eps=1e-6)
    _randomise_affine(norm)
    x = torch.randn(B, T, C).mul(50).to(torch.bfloat16).requires_grad_()
    y = norm(x)
    assert y.dtype == torch.bfloat16
    expected = F.rms_norm(x.detach().float(), (C,), norm.weight.detach(), 1e-6).to(torch.bfloat16)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.float32


def test_rms_norm_numbers() -> None:
    norm = _norm("rms", dim=2, eps=0.0)
    x = torch.tensor([3.0, 4.0])  # mean square 12.5
    torch.testing.assert_close(norm(x), x / math.sqrt(12.5), rtol=1e-6, atol=1e-6)
    assert norm(x + 1).mean() != 0  # not centred: differs from layer norm


def test_scale_norm_formula() -> None:
    norm = _norm("scale")
    assert norm.weight.numel() == 1
    torch.testing.assert_close(norm.weight.detach(), torch.tensor(math.sqrt(C)), rtol=0, atol=1e-6)
    with torch.no_grad():
        norm.weight.fill_(1.7)
    x = torch.randn(B, T, C) * 2 + 3
    torch.testing.assert_close(norm(x), 1.7 * x / x.norm(dim=-1, keepdim=True), **TOL)
    # at its initial gain sqrt(d), the output has unit RMS
    fresh = _norm("scale")
    torch.testing.assert_close(fresh(x).pow(2).mean(-1), torch.ones(B, T), rtol=1e-5, atol=1e-5)


def test_scale_norm_numbers() -> None:
    norm = _norm("scale", dim=2)
    torch.testing.assert_close(norm(torch.tensor([3.0, 4.0])), math.sqrt(2) * torch.tensor([0.6, 0.8]),
                               rtol=1e-6, atol=1e-6)


def test_batch_norm_train_uses_all_rows() -> None:
    norm = _norm("batch", eps=0.1)
    _randomise_affine(norm)
    w, b = norm.bn.weight.detach().clone(), norm.bn.bias.detach().clone()
    norm.train()
    x = torch.randn(B, T, C) * 2 + 3
    rows = x.reshape(-1, C)  # every (example, position)
    mean, var = rows.mean(0), rows.var(0, unbiased=False)
    torch.testing.assert_close(norm(x), (x - mean) / torch.sqrt(var + 0.1) * w + b, **TOL)
    # the running statistics moved by momentum 0.1 from (0, 1), with the unbiased variance
    torch.testing.assert_close(norm.bn.running_mean, 0.1 * mean, **TOL)
    torch.testing.assert_close(norm.bn.running_var, 0.9 + 0.1 * rows.var(0, unbiased=True), **TOL)


def test_batch_norm_eval_uses_running_stats() -> None:
    norm = _norm("batch", eps=0.1)
    _randomise_affine(norm)
    norm.train()
    norm(torch.randn(B, T, C) * 2 + 3)
    norm.eval()
    x = torch.randn(B, T, C)
    rm, rv = norm.bn.running_mean.clone(), norm.bn.running_var.clone()
    expected = (x - rm) / torch.sqrt(rv + 0.1) * norm.bn.weight + norm.bn.bias
    torch.testing.assert_close(norm(x), expected, **TOL)
    # and each example is then independent of the rest of the batch
    torch.testing.assert_close(norm(x[:1]), norm(x)[:1], **TOL)
    assert torch.equal(norm.bn.running_mean, rm)  # eval does not update the statistics


def test_none_is_identity() -> None:
    norm = _norm("none")
    x = torch.randn(B, T, C)
    assert norm(x) is x or torch.equal(norm(x), x)
    assert sum(p.numel() for p in norm.parameters()) == 0


def _leaks(norm: torch.nn.Module) -> bool:
    """Does changing the last position's activation change the output at earlier positions?"""
    x = torch.randn(B, T, C)
    x2 = x.clone()
    x2[:, -1] = torch.randn(B, C) * 5 + 2
    return not torch.allclose(norm(x)[:, :-1], norm(x2)[:, :-1], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", sorted(NORMS))
def test_only_batch_norm_leaks_across_positions_in_training(name: str) -> None:
    norm = _norm(name).train()
    assert _leaks(norm) == (name == "batch")


@pytest.mark.parametrize("name", sorted(NORMS))
def test_no_norm_leaks_in_eval(name: str) -> None:
    norm = _norm(name)
    norm.train()
    norm(torch.randn(B, T, C))  # batch norm: give the running statistics something to hold
    assert not _leaks(norm.eval())


def test_dyt_formula() -> None:
    """DyT(x) = γ ⊙ tanh(α·x) + β, written out with α, γ, β away from their inits; no statistic of x is read (a row
    scaled by 10 is not scaled back, as every norm above would)."""
    norm = _norm("dyt", alpha_init=0.7)
    _randomise_affine(norm)
    x = torch.randn(B, T, C) * 2
    a, g, b = norm.alpha.detach(), norm.weight.detach(), norm.bias.detach()
    torch.testing.assert_close(norm(x), g * torch.tanh(a * x) + b, **TOL)
    big = x.clone()
    big[0] *= 10
    torch.testing.assert_close(norm(big)[1:], norm(x)[1:], **TOL)  # per element: the other rows are untouched
    assert not torch.allclose(norm(big)[0], norm(x)[0])


def test_dyt_numbers_and_init() -> None:
    """At init (α₀ = 0.5, γ = 1, β = 0): tanh(x/2) elementwise; tanh(0.5·2) = 0.7616; bounded by ±1 however large x
    is. Its α is a learned scalar (in AdamW's `rest` group, no decay), `affine=false` keeps only α."""
    norm = _norm("dyt")
    assert norm.alpha.item() == 0.5 and norm.alpha.requires_grad
    y = norm(torch.tensor([[2.0, -2.0, 0.0, 1e4]]).expand(1, 4).repeat(1, 2)[:, :C])
    torch.testing.assert_close(y[0, :4], torch.tensor([0.7616, -0.7616, 0.0, 1.0]), rtol=0, atol=1e-4)
    bare = _norm("dyt", affine=False)
    assert [n for n, _ in bare.named_parameters()] == ["alpha"]
    x = torch.randn(B, T, C, requires_grad=True)
    bare(x).sum().backward()
    assert bare.alpha.grad is not None and torch.isfinite(bare.alpha.grad)
