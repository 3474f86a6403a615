"""The `head` axis (lmlab.model.head): multi-token prediction against DeepSeek-V3's and Gloeckle et al.'s equations
computed by hand, its evaluation equal to a single-head model's, and `model.untie_at_step`."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT, validate
from lmlab.model.head import HEADS
from tests.unit.model.options import trunk

V = 40


def _model(head: dict | None = None, **kw) -> GPT:
    base = dict(vocab_size=V, n_layer=2, d_model=32, n_head=4, max_seq_len=16, position={"name": "rope"},
                norm={"name": "rms"}, head=head or {"name": "next"})
    torch.manual_seed(0)
    return GPT(validate(GPTConfig(**{**base, **kw})))


def _batch(T: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, V, (2, T + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _ce(model: GPT, norm, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy((norm(h) @ model.wte.weight.T).flatten(0, 1), targets.flatten())


def test_sequential_mtp_is_deepseek_v3s_equation() -> None:
    """h⁰ = h, hᵏ_i = TRM_k(M_k [RMSNorm(hᵏ⁻¹_i); RMSNorm(Emb(t_{i+k}))]) for i < T − k; L_k its cross-entropy on
    t_{i+k+1} through the shared head; the objective adds λ/D · Σ L_k."""
    model = _model({"name": "mtp", "depth": 2, "weight": 0.5}).train()
    idx, targets = _batch()
    objective, ce, _ = model(idx, targets, parts=True)
    mtp = model.head
    with torch.no_grad():
        h, expected = trunk(model, idx), []
        T = idx.size(1)
        for k in (1, 2):
            n = T - k
            x = torch.cat((mtp.norm_h[k - 1](h[:, :n]), mtp.norm_e[k - 1](model.wte(idx[:, k:]))), dim=-1)
            h = mtp.blocks[k - 1](x @ mtp.proj[k - 1].weight.T, model.pos)
            expected.append(_ce(model, mtp.norms[k - 1], h, targets[:, k:]))
        next_token = _ce(model, model.ln_f, trunk(model, idx), targets)
    torch.testing.assert_close(torch.stack(model.head_losses), torch.stack(expected))
    torch.testing.assert_close(ce, next_token)
    torch.testing.assert_close(objective, next_token + 0.25 * (expected[0] + expected[1]))
    assert model.head_losses[1] != model.head_losses[0]


def test_parallel_heads_each_read_the_trunk_and_take_their_own_weight() -> None:
    """hᵏ_i = TRM_k(h_i) for i < T − k, each predicting t_{i+k+1}: the heads read the trunk, not each other."""
    model = _model({"name": "mtp", "depth": 3, "style": "parallel", "weights": [0.3, 0.2, 0.1]}).train()
    idx, targets = _batch()
    objective, ce, _ = model(idx, targets, parts=True)
    mtp = model.head
    with torch.no_grad():
        h = trunk(model, idx)
        T = idx.size(1)
        expected = [_ce(model, mtp.norms[k - 1], mtp.blocks[k - 1](h[:, :T - k], model.pos), targets[:, k:])
                    for k in (1, 2, 3)]
    torch.testing.assert_close(torch.stack(model.head_losses), torch.stack(expected))
    torch.testing.assert_close(objective, ce + 0.3 * expected[0] + 0.2 * expected[1] + 0.1 * expected[2])
    assert not hasattr(mtp, "proj")


@pytest.mark.parametrize("style", ["sequential", "parallel"])
def test_evaluation_is_a_single_head_models_next_token_loss(style: str) -> None:
    """The trunk is the model: with the MTP modules left out, a head=next model with the same weights gives the same
    logits and the same loss; in eval (and under no_grad) the loss returned is the next token's alone."""
    mtp = _model({"name": "mtp", "depth": 2, "style": style})
    single = _model()
    missing = single.load_state_dict({k: v for k, v in mtp.state_dict().items() if not k.startswith("head.")})
    assert not missing.missing_keys and not missing.unexpected_keys
    idx, targets = _batch()
    mtp.eval(), single.eval()
    with torch.no_grad():
        torch.testing.assert_close(mtp(idx), single(idx))
        torch.testing.assert_close(mtp(idx, targets), single(idx, targets))
    assert len(mtp.head_losses) == 2 and all(v > 0 for v in mtp.head_losses)  # computed apart, for val/mtp_loss_k
    mtp.train()
    with torch.no_grad():  # no gradient: not a training step, the objective is not formed
        torch.testing.assert_close(mtp(idx, targets), single(idx, targets))


def test_mtp_losses_are_causal_and_reach_every_module() -> None:
    """Depth k at position i reads tokens up to t_{i+k} only: changing the tokens after position p leaves the depth-k
    states of positions i < p − k unchanged; the objective's gradient reaches every MTP weight."""
    model = _model({"name": "mtp", "depth": 2}).train()
    idx, targets = _batch()
    states = []
    hooks = [b.register_forward_hook(lambda m, a, o: states.append(o)) for b in model.head.blocks]
    model(idx, targets).backward()
    for name, p in model.head.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    p = 7
    other = idx.clone()
    other[:, p:] = (other[:, p:] + 1) % V
    with torch.no_grad():
        model(other, targets)
    for hook in hooks:
        hook.remove()
    (a1, a2), (b1, b2) = states[:2], states[2:]
    for k, a, b in ((1, a1, b1), (2, a2, b2)):
        torch.testing.assert_close(a[:, : p - k], b[:, : p - k])
        assert not torch.allclose(a[:, p - k], b[:, p - k])  # position p − k reads t_p


def test_the_size_estimate_counts_the_mtp_modules() -> None:
    from lmlab.model.resolve import n_params_estimate

    for head in ({"name": "mtp", "depth": 2}, {"name": "mtp", "depth": 1, "style": "parallel"}):
        model = _model(head)
        assert n_params_estimate(model.cfg) == pytest.approx(model.num_params(), rel=0.01)
        assert HEADS["mtp"].n_params(model.cfg, **{k: v for k, v in head.items() if k != "name"}) > 0


def test_flops_count_the_extra_depths() -> None:
    from lmlab.model.flops import flops_per_token

    base, mtp = _model(), _model({"name": "mtp", "depth": 1})
    extra = flops_per_token(mtp, 16)["train"] - flops_per_token(base, 16)["train"]
    d, block = 32, 12 * 32 * 32  # a transformer layer's matmul weights at the MLP's 4x width
    assert extra == 6 * (block + 2 * d * d + V * d) + 6 * 16 * 2 * d  # its block, M_1, the head again, its scores


@pytest.mark.parametrize(("overrides", "message"), [
    (["head=mtp", "head.depth=2", "head.weights=[0.1]"], "head.weights=[0.1] must give one weight >= 0 per depth"),
    (["head=mtp", "head.style=tree"], "head.style='tree'"),
    (["head=mtp", "head.depth=0"], "head.depth=0"),
    (["model.untie_at_step=5", "model.tie_embeddings=false"], "model.untie_at_step=5 unties a tied head"),
    (["model.untie_at_step=0"], "model.untie_at_step=0"),
    (["model.untie_at_step=5", "trainer.strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2"],
     "use trainer.strategy=ddp_find_unused_parameters_true"),
])
def test_bad_head_input_is_named_before_training(overrides: list[str], message: str) -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_config(compose(overrides))


def test_untie_at_step_starts_tied_then_copies_the_embedding_and_trains_apart() -> None:
    model = _model(untie_at_step=3).train()
    idx, targets = _batch()
    assert model.tied and model.head_weight is model.wte.weight
    model(idx, targets).backward()
    assert model.lm_head.weight.grad is None  # unused while tied: no update, no decay
    tied_logits = model.eval()(idx)
    model.untie()
    assert not model.tied and torch.equal(model.lm_head.weight, model.wte.weight)
    assert model.lm_head.weight.data_ptr() != model.wte.weight.data_ptr()
    torch.testing.assert_close(model(idx), tied_logits)  # the same function at the moment of untying
    model.train().zero_grad()
    model(idx, targets).backward()
    assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0
    restored = _model(untie_at_step=3)
    restored.load_state_dict(model.state_dict())
    assert not restored.tied  # the untying is saved with the weights
    assert "untied" not in _model().state_dict()  # other models keep their keys (old checkpoints load)


@pytest.mark.parametrize("untie", [False, True])
def test_hf_export_of_an_mtp_model_is_its_next_token_model_with_parity(untie: bool) -> None:
    """transformers' Llama computes the trunk's logits: the MTP modules are left out, the head exported as it is at
    that moment (tied before model.untie_at_step, its own matrix after)."""
    pytest.importorskip("transformers")
    from lmlab.interop.hf import to_hf

    model = _model({"name": "mtp", "depth": 2}, untie_at_step=4, ffn={"name": "swiglu", "hidden_mult": 4,
                                                                     "multiple_of": 32})
    if untie:
        model.untie()
        with torch.no_grad():
            model.lm_head.weight.add_(0.05 * torch.randn_like(model.lm_head.weight))  # trained apart
    idx, _ = _batch()
    hf = to_hf(model.eval())
    assert hf.config.tie_word_embeddings is (not untie)
    with torch.no_grad():
        torch.testing.assert_close(hf(idx).logits, model(idx), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block", ["transformer", "gau"])
@pytest.mark.parametrize("placement", ["pre", "post", "deepnorm", "double", "post_nonres"])
def test_mtp_composes_with_every_placement_and_block(placement: str, block: str) -> None:
    """Each MTP module is a block of the model's own kind and placement: every combination trains."""
    model = _model({"name": "mtp", "depth": 2}, placement={"name": placement},
                   block={"name": block, **({"s": 16} if block == "gau" else {})}).train()
    assert type(model.head.blocks[0]) is type(model.h[0])
    idx, targets = _batch()
    objective, ce, _ = model(idx, targets, parts=True)
    objective.backward()
    assert torch.isfinite(objective) and objective > ce
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.head.parameters())
