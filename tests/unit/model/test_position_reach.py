"""Where a position scheme reaches the model (issue 63's defects 1-3, each reproduced from the command line first):
QK-clip refused with a scheme that biases the logits (its measured maximum counted a bias W_q, W_k lack, and it
shrank them every step: ‖W_q‖ 0.0068 under T5 against 0.122 under RoPE after 20 steps); a learned logit bias refused
in a model where no layer attends (no gradient: DDP stopped after step 1); norm=ngpt with T5 and FIRE, which it
lists, trains (it stopped on the bias table's shape)."""

from __future__ import annotations

import pytest
import torch

from lmlab import build_model, compose
from lmlab.run.checks import check_config

SMALL = ["model.n_layer=2", "model.d_model=32", "model.n_head=2"]


@pytest.mark.parametrize("position", ["t5", "fire", "cope", "alibi"])
def test_qk_clip_is_refused_with_a_logit_bias(position: str) -> None:
    with pytest.raises(ValueError, match=rf"optim\.qk_clip=50\.0 with position={position} adds .* use position=rope"):
        check_config(compose([f"position={position}", "optim.qk_clip=50.0", *SMALL]))
    check_config(compose(["position=rope", "optim.qk_clip=50.0", *SMALL]))  # a rotation: the clip bounds q·k


@pytest.mark.parametrize("position", ["t5", "fire", "cope"])
def test_a_learned_logit_bias_needs_a_layer_that_attends(position: str) -> None:
    with pytest.raises(ValueError, match=rf"position={position} adds learned biases .* no layer of this model attends"):
        check_config(compose(["mixer=gdn", f"position={position}", *SMALL]))
    model = build_model(compose(["mixer=gdn", "mixer.pattern=[gdn,attention]", f"position={position}", *SMALL]),
                        vocab_size=64)  # a hybrid: its attention layer reads the bias, which learns
    x = torch.randint(0, 64, (2, 8))
    model(x, x).backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.pos.parameters())


@pytest.mark.parametrize("position", ["t5", "fire"])
def test_ngpt_trains_with_the_bias_schemes_it_lists(position: str) -> None:
    """The stream's matrices on the sphere; the scheme's own weights (they act on logits) left as they are."""
    torch.manual_seed(0)
    model = build_model(compose(["norm=ngpt", f"position={position}", *SMALL]), vocab_size=64)
    before = {n: p.detach().clone() for n, p in model.pos.named_parameters()}
    x = torch.randint(0, 64, (2, 8))
    model(x, x).backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    moved = {n: p.detach().clone() for n, p in model.pos.named_parameters()}
    model.normalize_weights()
    for n, p in model.pos.named_parameters():
        assert torch.equal(p, moved[n]), n  # not renormalised
    assert any(not torch.equal(p, before[n]) for n, p in model.pos.named_parameters())  # trained
    rows = model.h[0].attn.c_attn.weight.norm(dim=1)
    torch.testing.assert_close(rows, torch.ones_like(rows))  # the stream's matrices are on the sphere
