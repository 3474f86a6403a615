"""lmlab.model.loss.cross_entropy is torch's mean token cross-entropy, in value and gradient: the closed-form backward
(softmax − onehot, scaled) is checked numerically, against F.cross_entropy with ignored targets, on bf16 logits,
and through LitGPT's loss on a real model. linear_cross_entropy (the head and the loss in row blocks, for
`model.chunked_loss`) is the same loss and the same gradients, and keeps no (tokens, vocab) tensor for backward."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.model.loss import cross_entropy, linear_cross_entropy
from lmlab.run.lit import LitGPT


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


# ---- linear_cross_entropy: the head and the loss in row blocks --------------------------------------------------

def _head_inputs(n: int = 37, d: int = 8, v: int = 11, dtype=torch.float32):
    torch.manual_seed(4)
    h = torch.randn(n, d, dtype=dtype, requires_grad=True)
    w = torch.randn(v, d, dtype=dtype, requires_grad=True)
    t = torch.randint(0, v, (n,))
    t[[3, 20]] = -100
    return h, w, t


def test_linear_cross_entropy_gradcheck_over_several_blocks() -> None:
    h, w, t = _head_inputs(dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: linear_cross_entropy(a, b, t, chunk_elems=55), (h, w))  # 5 rows


@pytest.mark.parametrize("chunk_elems", [1, 55, 11 * 37, 1 << 25])  # one row per block .. one block
def test_linear_cross_entropy_equals_the_unchunked_loss(chunk_elems: int) -> None:
    h, w, t = _head_inputs()
    ours = linear_cross_entropy(h, w, t, chunk_elems=chunk_elems)
    ref = F.cross_entropy(h @ w.t(), t)
    assert ours.item() == pytest.approx(ref.item(), abs=1e-6)
    for a, b in zip(torch.autograd.grad(ours, (h, w)), torch.autograd.grad(ref, (h, w))):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # no gradients wanted: the loss alone, block by block
        assert linear_cross_entropy(h, w, t, chunk_elems=chunk_elems).item() == pytest.approx(ref.item(), abs=1e-6)


def test_linear_cross_entropy_under_bf16_autocast_matches_the_head_linear() -> None:
    h, w, t = _head_inputs(n=64, d=16, v=50)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(h, w, t, chunk_elems=500)
        ref = cross_entropy(F.linear(h, w), t)  # what GPT.forward does without chunking
    assert ours.dtype == torch.float32 and ours.item() == pytest.approx(ref.item(), rel=1e-3)
    g_ours, g_ref = torch.autograd.grad(ours, (h, w)), torch.autograd.grad(ref, (h, w))
    for a, b in zip(g_ours, g_ref):
        assert a.dtype == b.dtype == torch.float32  # the parameters' dtype, as autocast's Linear gives back
        torch.testing.assert_close(a, b, atol=1e-2 * b.abs().max().item(), rtol=0)  # bf16 matmuls (eps 2^-7)


@pytest.mark.parametrize("tied", [True, False])
def test_gpt_chunked_loss_has_the_same_loss_and_gradients(tied: bool) -> None:
    from lmlab.config import GPTConfig
    from lmlab.model.gpt import GPT

    cfg = dict(vocab_size=97, n_layer=2, d_model=32, n_head=4, max_seq_len=16, tie_embeddings=tied)
    torch.manual_seed(5)
    plain = GPT(GPTConfig(**cfg))
    chunked = GPT(GPTConfig(**cfg, chunked_loss=True))
    chunked.load_state_dict(plain.state_dict())
    x, y = torch.randint(0, 97, (3, 16)), torch.randint(0, 97, (3, 16))
    losses = [m(x, y) for m in (plain, chunked)]
    assert losses[1].item() == pytest.approx(losses[0].item(), abs=1e-6)
    assert losses[0].item() == pytest.approx(F.cross_entropy(plain(x).flatten(0, 1), y.flatten()).item(), abs=1e-6)
    for loss, m in zip(losses, (plain, chunked)):
        loss.backward()
    for (name, a), b in zip(plain.named_parameters(), chunked.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)


def test_chunked_loss_keeps_no_logits_for_backward() -> None:
    from lmlab.config import GPTConfig
    from lmlab.model.gpt import GPT

    def saved_bytes(model: GPT, x: torch.Tensor, y: torch.Tensor) -> int:
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                      lambda t: t):
            model(x, y).backward()
        return sum(saved)

    cfg = dict(vocab_size=4000, n_layer=1, d_model=16, n_head=2, max_seq_len=64)
    x, y = torch.randint(0, 4000, (4, 64)), torch.randint(0, 4000, (4, 64))
    plain = saved_bytes(GPT(GPTConfig(**cfg)), x, y)
    chunked = saved_bytes(GPT(GPTConfig(**cfg, chunked_loss=True)), x, y)
    logits = 4 * 64 * 4000 * 4  # the fp32 (N, V) log-probs the unchunked loss keeps
    assert plain - chunked > 0.5 * logits, (plain, chunked)


def test_compute_keys_may_change_on_resume() -> None:
    from lmlab.config import COMPUTE_KEYS
    from lmlab.run.training import check_same_arch

    saved = {"vocab_size": 50, "n_layer": 2, "d_model": 32}  # a checkpoint from before chunked_loss existed
    check_same_arch("resume", {"vocab_size": 50, "n_layer": 2, "d_model": 32, "checkpointing": True,
                               "chunked_loss": True}, saved, ("dropout", *COMPUTE_KEYS))
    with pytest.raises(ValueError, match="model/d_model"):
        check_same_arch("resume", {"vocab_size": 50, "n_layer": 2, "d_model": 64, "chunked_loss": True}, saved,
                        COMPUTE_KEYS)


def _reference(z: torch.Tensor, t: torch.Tensor, softcap, z_loss: float, ignore: int = -100) -> torch.Tensor:
    """Softcap then cross-entropy, plus λ·mean over the counted rows of logsumexp², written with torch's ops."""
    import torch.nn.functional as F

    if softcap == "rescale":  # the GPT-2 speedrun's record 54, as its code writes it (a constant above ours)
        capped = 23 * torch.sigmoid((z + 5) / 7.5) - (11.5 if z_loss else 0.0)
    else:
        capped = z if softcap is None else softcap * torch.tanh(z / softcap)
    valid = t != ignore
    return F.cross_entropy(capped, t, ignore_index=ignore) + z_loss * capped.logsumexp(-1)[valid].square().mean()


CAPS = [(None, 1e-2), (2.0, 0.0), (1.5, 0.1), ("rescale", 0.0), ("rescale", 0.1)]


def _cap(softcap):
    from lmlab.model.loss import Softcap

    return Softcap(11.5, 15.0, 5.0) if softcap == "rescale" else softcap


@pytest.mark.parametrize("softcap,z_loss", CAPS)
def test_the_softcap_and_the_z_loss_are_their_formulas_on_both_paths(softcap, z_loss) -> None:
    """The softcap c·tanh(z / c), and the speedrun's asymmetric logit rescale 23·σ((z + 5) / 7.5) (record 54: a
    Softcap of c 11.5, width 15, offset 5, its constant 11.5 dropped, which the cross-entropy does not see)."""
    from lmlab.model.loss import linear_cross_entropy

    reference, softcap = softcap, _cap(softcap)
    torch.manual_seed(0)
    x = (torch.randn(12, 9, dtype=torch.float64) * 3).requires_grad_()
    t = torch.randint(0, 9, (12,))
    t[3] = -100
    assert torch.autograd.gradcheck(lambda a: cross_entropy(a, t, softcap=softcap, z_loss=z_loss), (x,))
    total, ce, zl = cross_entropy(x, t, softcap=softcap, z_loss=z_loss, parts=True)
    torch.testing.assert_close(total, _reference(x, t, reference, z_loss))
    torch.testing.assert_close(ce, _reference(x, t, reference, 0.0))
    assert not ce.requires_grad and not zl.requires_grad
    h = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(9, 5, dtype=torch.float64, requires_grad=True)
    ours = linear_cross_entropy(h, w, t, softcap=softcap, z_loss=z_loss, chunk_elems=27)  # 3-row blocks
    ref = _reference(h @ w.t(), t, reference, z_loss)
    torch.testing.assert_close(ours, ref)
    g_ours = torch.autograd.grad(ours, (h, w))
    g_ref = torch.autograd.grad(ref, (h, w))
    for a, b in zip(g_ours, g_ref):
        torch.testing.assert_close(a, b)


def test_the_final_logit_softcap_bounds_the_models_logits_and_its_loss_is_theirs() -> None:
    from lmlab.config import GPTConfig
    from lmlab.model.gpt import GPT, validate

    torch.manual_seed(0)
    kw = dict(vocab_size=20, n_layer=1, d_model=16, n_head=2, max_seq_len=8)
    capped, plain = GPT(validate(GPTConfig(**kw, logit_softcap=0.5))), GPT(validate(GPTConfig(**kw)))
    plain.load_state_dict(capped.state_dict())
    with torch.no_grad():
        for p in capped.parameters():
            p.mul_(5)  # large logits
        plain.load_state_dict(capped.state_dict())
    idx, y = torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (2, 8))
    z = plain(idx)
    assert z.abs().max() > 2 and capped(idx).abs().max() <= 0.5
    torch.testing.assert_close(capped(idx), 0.5 * torch.tanh(z / 0.5))
    torch.testing.assert_close(capped(idx, y), F.cross_entropy((0.5 * torch.tanh(z / 0.5)).flatten(0, 1), y.flatten()))


def test_the_models_asymmetric_logit_rescale_is_the_speedruns_and_refused_without_a_cap() -> None:
    """model.logit_softcap=11.5 logit_softcap_width=15 logit_softcap_offset=5: the logits are 23·σ((z + 5) / 7.5)
    − 11.5 (generation) and the loss is the cross-entropy of 23·σ((z + 5) / 7.5), on both loss paths; a width or an
    offset without a cap is refused by key."""
    from lmlab.config import GPTConfig
    from lmlab.model.gpt import GPT, validate

    torch.manual_seed(0)
    kw = dict(vocab_size=20, n_layer=1, d_model=16, n_head=2, max_seq_len=8)
    rescale = dict(logit_softcap=11.5, logit_softcap_width=15.0, logit_softcap_offset=5.0)
    plain = GPT(validate(GPTConfig(**kw)))
    with torch.no_grad():
        for p in plain.parameters():
            p.mul_(12)  # logits over the cap's range
    capped, chunked = (GPT(validate(GPTConfig(**kw, **rescale, chunked_loss=c))) for c in (False, True))
    capped.load_state_dict(plain.state_dict())
    chunked.load_state_dict(plain.state_dict())
    idx, y = torch.randint(0, 20, (2, 8)), torch.randint(0, 20, (2, 8))
    z = plain(idx)
    assert z.abs().max() > 15  # the cap is 11.5
    record = 23 * torch.sigmoid((z + 5) / 7.5)
    torch.testing.assert_close(capped(idx), record - 11.5)
    for model in (capped, chunked):
        torch.testing.assert_close(model(idx, y), F.cross_entropy(record.flatten(0, 1), y.flatten()))
    for key, value in (("logit_softcap_width", 15.0), ("logit_softcap_offset", 5.0)):
        with pytest.raises(ValueError, match=f"model.{key}={value} .*model.logit_softcap=null"):
            validate(GPTConfig(**kw, **{key: value}))


@pytest.mark.parametrize("softcap,z_loss", CAPS)
def test_the_chunked_loss_without_gradients_is_the_objective(softcap, z_loss) -> None:
    """Evaluation (no gradient wanted) takes its own path, which computes no gradient: the same objective and parts."""
    from lmlab.model.loss import linear_cross_entropy

    reference, softcap = softcap, _cap(softcap)
    torch.manual_seed(1)
    h, w = torch.randn(12, 5, dtype=torch.float64), torch.randn(9, 5, dtype=torch.float64)
    t = torch.randint(0, 9, (12,))
    t[4] = -100
    with torch.no_grad():
        total, ce, zl = linear_cross_entropy(h, w, t, softcap=softcap, z_loss=z_loss, chunk_elems=27, parts=True)
        plain = linear_cross_entropy(h, w, t, softcap=softcap, z_loss=z_loss, chunk_elems=27)
    torch.testing.assert_close(total, _reference(h @ w.t(), t, reference, z_loss))
    torch.testing.assert_close(plain, total)
    torch.testing.assert_close(ce, _reference(h @ w.t(), t, reference, 0.0))
