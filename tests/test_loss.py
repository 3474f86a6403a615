"""lmlab.loss.cross_entropy is torch's mean token cross-entropy, in value and gradient: the closed-form backward
(softmax − onehot, scaled) is checked numerically, against F.cross_entropy with ignored targets, on bf16 logits,
and through LitGPT's loss on a real model."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.lit import LitGPT
from lmlab.loss import cross_entropy


def test_gradcheck_with_ignored_rows() -> None:
    torch.manual_seed(0)
    x = torch.randn(9, 7, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 6, -100, 3, 3, -100, 1, 2, 5])
    assert torch.autograd.gradcheck(lambda a: cross_entropy(a, t), (x,))


@pytest.mark.parametrize("ignored", [0, 5])
def test_equals_torch_cross_entropy(ignored: int) -> None:
    torch.manual_seed(1)
    x = (3 * torch.randn(2, 10, 33)).requires_grad_()
    t = torch.randint(0, 33, (2, 10))
    t.view(-1)[torch.randperm(20)[:ignored]] = -100
    ours = cross_entropy(x, t)
    ref = F.cross_entropy(x.flatten(0, 1), t.flatten())
    (g_ours,), (g_ref,) = torch.autograd.grad(ours, x), torch.autograd.grad(ref, x)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-6)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-7, rtol=1e-5)
    if ignored:  # ignored rows get no gradient at all
        assert (g_ours.view(20, 33)[t.view(-1) == -100] == 0).all()


def test_gradient_by_hand() -> None:
    """One row, mean over 2 rows: d/dx_j = (softmax_j − [j = target]) / 2."""
    x = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], requires_grad=True)
    loss = cross_entropy(x, torch.tensor([2, 0]))
    e = [math.exp(1), math.exp(2), math.exp(3)]
    expected_loss = (-math.log(e[2] / sum(e)) + math.log(3)) / 2
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    loss.backward()
    row0 = [(v / sum(e) - (i == 2)) / 2 for i, v in enumerate(e)]
    row1 = [(1 / 3 - (i == 0)) / 2 for i in range(3)]
    torch.testing.assert_close(x.grad, torch.tensor([row0, row1]))


def test_bf16_logits_are_read_in_fp32_and_get_a_bf16_gradient() -> None:
    torch.manual_seed(2)
    x = torch.randn(16, 50).bfloat16().requires_grad_()
    t = torch.randint(0, 50, (16,))
    ours = cross_entropy(x, t)
    assert ours.dtype == torch.float32
    ref = F.cross_entropy(x.float(), t)  # what LitGPT did before: upcast, then torch's loss
    assert ours.item() == pytest.approx(ref.item(), abs=1e-6)
    (g_ours,), (g_ref,) = torch.autograd.grad(ours, x), torch.autograd.grad(ref, x)
    assert g_ours.dtype == torch.bfloat16
    torch.testing.assert_close(g_ours, g_ref, atol=1e-4, rtol=1e-2)  # fp32 maths, one rounding to bf16


def test_all_ignored_is_nan_like_torch() -> None:
    x = torch.randn(4, 5)
    assert math.isnan(cross_entropy(x, torch.full((4,), -100)).item())
    assert math.isnan(F.cross_entropy(x, torch.full((4,), -100)).item())


def test_litgpt_loss_has_torch_gradients() -> None:
    torch.manual_seed(3)
    lit = LitGPT(model=dict(vocab_size=40, n_layer=2, d_model=32, n_head=4, max_seq_len=16),
                 optim={"name": "adamw"}, schedule={"name": "constant"}, max_steps=1)
    x, y = torch.randint(0, 40, (2, 16)), torch.randint(0, 40, (2, 16))
    ours = lit.loss((x, y))
    g_ours = torch.autograd.grad(ours, list(lit.parameters()))
    ref = F.cross_entropy(lit(x).flatten(0, 1).float(), y.flatten())
    g_ref = torch.autograd.grad(ref, list(lit.parameters()))
    assert ours.item() == pytest.approx(ref.item(), abs=1e-6)
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
