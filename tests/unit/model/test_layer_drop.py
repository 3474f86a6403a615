"""residual=layer_drop (stochastic depth): each branch dropped per sequence with p_l while training and scaled by
1/(1 − p_l) where kept; the standard model in evaluation; Huang et al.'s linear rule p_l = rate·(l + 1)/L."""

from __future__ import annotations

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.model.residual.layer_drop import DropBranch

BASE = dict(vocab_size=50, n_layer=4, d_model=32, n_head=4, max_seq_len=16)


def _pair(placement: str = "pre", **drop) -> tuple[GPT, GPT]:
    """A model with layer_drop and the standard one with the same weights."""
    torch.manual_seed(0)
    dropped = GPT(GPTConfig(**BASE, placement={"name": placement}, residual={"layer_drop": drop}))
    standard = GPT(GPTConfig(**BASE, placement={"name": placement}))
    assert standard.load_state_dict(dropped.state_dict()) is not None  # layer_drop has no weights
    return dropped, standard


def test_the_linear_rule_drops_the_last_layer_most() -> None:
    dropped, _ = _pair(rate=0.2)
    assert [b.layer_drop.p for b in dropped.h] == pytest.approx([0.05, 0.10, 0.15, 0.20])
    uniform, _ = _pair(rate=0.2, linear=False)
    assert [b.layer_drop.p for b in uniform.h] == pytest.approx([0.2] * 4)


def test_each_sequence_keeps_or_drops_the_whole_branch_and_keeps_its_expectation() -> None:
    drop = DropBranch(0.3).train()
    torch.manual_seed(0)
    y = torch.randn(20000, 3, 4)
    out = drop(1, y)
    ratio = out / y  # per sequence: 0 (dropped) or 1/(1 − p) (kept), the same at every position and channel
    per_seq = ratio.flatten(1)
    assert torch.allclose(per_seq, per_seq[:, :1].expand_as(per_seq))
    values = per_seq[:, 0]
    kept = values > 0
    assert torch.allclose(values[kept], torch.full_like(values[kept], 1 / 0.7))
    assert (~kept).float().mean().item() == pytest.approx(0.3, abs=0.01)  # 20,000 draws: σ ≈ 0.003
    assert out.mean(0).sub(y.mean(0)).abs().max() < 0.05  # E[m/(1 − p)] = 1


@pytest.mark.parametrize("placement", ["pre", "post", "deepnorm", "double"])
def test_in_evaluation_it_is_the_standard_model(placement: str) -> None:
    dropped, standard = _pair(placement, rate=0.5)
    idx = torch.randint(0, 50, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(dropped.eval()(idx), standard.eval()(idx))


def test_in_training_a_dropped_branch_leaves_the_stream_as_it_was() -> None:
    """rate 0.9 on a 1-layer model (p = 0.9): the block passes a sequence through unchanged when both its sublayers'
    branches are dropped (0.81 of them) and changes every other one."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**dict(BASE, n_layer=1), residual={"layer_drop": {"rate": 0.9}})).train()
    seen = {}
    model.h[0].register_forward_hook(lambda m, args, out: seen.update(x=args[0], y=out))
    with torch.no_grad():
        model(torch.randint(0, 50, (400, 16)))
    unchanged = (seen["y"] - seen["x"]).flatten(1).abs().amax(1) == 0
    assert unchanged.float().mean().item() == pytest.approx(0.81, abs=0.06)  # 400 draws: σ ≈ 0.02
    assert ((seen["y"] - seen["x"])[~unchanged].flatten(1).abs().amax(1) > 1e-3).all()


def test_a_rate_of_one_or_more_is_refused_by_key() -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=r"residual\.layer_drop\.rate"):
        check_config(compose(["residual=layer_drop", "residual.layer_drop.rate=1.0"]))
    check_config(compose(["residual=layer_drop", "residual.layer_drop.rate=0.3"]))


def test_it_trains_and_its_gradient_reaches_every_layer() -> None:
    dropped, _ = _pair(rate=0.2)
    dropped.train()
    idx = torch.randint(0, 50, (8, 16))
    torch.manual_seed(3)
    loss = torch.nn.functional.cross_entropy(dropped(idx).flatten(0, 1), idx.roll(-1, 1).flatten())
    loss.backward()
    assert torch.isfinite(loss)
    assert all(b.attn.c_proj.weight.grad.abs().sum() > 0 for b in dropped.h)
