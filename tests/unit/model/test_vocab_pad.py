"""model.vocab_pad: the embedding and head padded to a multiple of rows (a GPU's matmul shapes), the extra rows' logits
out of the loss, the softmax, the counts and the export. Checked against the unpadded model holding the same weights:
the same logits, loss and gradients, the padded rows untouched by any gradient, the same parameter and FLOP counts,
and the export (transformers' GPT-2) unpadded with the same logits."""

from __future__ import annotations

import pytest
import torch

from lmlab import build_model, compose
from lmlab.model.flops import flops_per_token
from lmlab.model.gpt import GPT

V, PAD = 50, 16  # 50 ids -> 64 rows
BASE = ["model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.max_seq_len=16", "model.dropout=0.0"]


def _pair(*extra: str) -> tuple[GPT, GPT]:
    """(padded, plain): the plain model's weights are the padded one's vocabulary rows, the rest equal."""
    torch.manual_seed(0)
    padded = build_model(compose([*BASE, f"model.vocab_pad={PAD}", *extra]), vocab_size=V)
    plain = build_model(compose([*BASE, *extra]), vocab_size=V)
    state = padded.state_dict()
    for name, rows in padded.vocab_rows.items():
        if name in state:
            state[name] = state[name][:rows]
    plain.load_state_dict(state)
    return padded, plain


def test_the_rows_are_padded_to_the_multiple() -> None:
    padded, plain = _pair()
    assert padded.wte.weight.shape == (64, 32) and padded.lm_head.weight.shape == (64, 32)
    assert plain.wte.weight.shape == (V, 32)
    padded, _ = _pair("model.vocab_pad=1")
    assert padded.wte.weight.shape == (V, 32)  # 1: as before


@pytest.mark.parametrize("extra", [(), ("model.tie_embeddings=false",), ("model.chunked_loss=true",),
                                   ("model.logit_softcap=5.0",), ("norm=ngpt",)],
                         ids=["tied", "untied", "chunked", "softcap", "ngpt"])
def test_logits_loss_and_gradients_are_the_unpadded_models(extra: tuple[str, ...]) -> None:
    padded, plain = _pair(*extra)
    idx = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(1))
    y = torch.randint(0, V, (3, 16), generator=torch.Generator().manual_seed(2))
    padded.eval(), plain.eval()
    with torch.no_grad():
        logits = padded(idx)
        assert logits.shape == (3, 16, V)  # nothing past the vocabulary reaches a softmax or a sampler
        torch.testing.assert_close(logits, plain(idx), rtol=1e-5, atol=1e-5)
    padded.train(), plain.train()
    z = {"z_loss": 1e-3, "parts": True} if "softcap" in str(extra) else {}
    loss_p, loss_q = padded(idx, y, **z), plain(idx, y, **z)
    loss_p, loss_q = (loss_p[0], loss_q[0]) if z else (loss_p, loss_q)
    torch.testing.assert_close(loss_p, loss_q, rtol=1e-5, atol=1e-6)
    assert abs(float(loss_q.detach()) - torch.log(torch.tensor(float(V)))) < 1.0  # a near-uniform start over V, not 64 ids
    loss_p.backward(), loss_q.backward()
    grads = dict(plain.named_parameters())
    for name, p in padded.named_parameters():
        rows = padded.vocab_rows.get(name)
        g = p.grad if rows is None else p.grad[:rows]
        torch.testing.assert_close(g, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
        if rows is not None:
            assert not p.grad[rows:].any(), name  # the padded rows: no gradient, ever


def test_counts_are_the_vocabularys() -> None:
    for extra in ((), ("model.tie_embeddings=false",)):
        padded, plain = _pair(*extra)
        assert padded.num_params() == plain.num_params()
        assert padded.num_params(exclude_embeddings=True) == plain.num_params(exclude_embeddings=True)
        assert flops_per_token(padded, 16) == flops_per_token(plain, 16)
    # by hand, tied: the embedding's 50 x 32 once, however many rows the matmul has
    padded, _ = _pair()
    n_rows = sum(p.numel() for p in padded.parameters()) - padded.num_params()
    assert n_rows == (64 - V) * 32


def test_generation_and_the_export_are_unpadded() -> None:
    from lmlab.interop.hf import to_hf

    padded, plain = _pair("model.tie_embeddings=false")
    padded.eval()
    exported = padded.next_token_model()
    assert exported.cfg.vocab_pad == 1 and exported.wte.weight.shape == (V, 32)
    assert exported.lm_head.weight.shape == (V, 32)
    idx = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        hf = to_hf(padded).eval()
        assert hf.config.vocab_size == V
        torch.testing.assert_close(hf(idx).logits, padded(idx), rtol=1e-4, atol=1e-4)
