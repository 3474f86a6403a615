"""residual=smear (the GPT-2 speedrun's record 34): x_t + λ·σ(w·x_t[:g])·x_{t−1} on a hand example; the model's
embedding output (x0 included) smeared before the embedding norm; init=0 the standard model; cached generation equal
to the full forward; the optimizer roles; refusals by key. Causality, a packed document read alone and training:
test_residual_options.py, over the options."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lmlab import build_model, compose
from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.gpt import GPT, validate
from lmlab.model.residual.smear import Smear
from lmlab.optim import OPTIMIZERS, param_groups
from tests.unit.model.options import assert_refused

V, EOD = 40, 0
BASE = dict(vocab_size=V, n_layer=2, d_model=32, n_head=4, max_seq_len=32, position={"name": "rope"},
            norm={"name": "rms"})


def _model(smear: dict | None = None, **kw) -> GPT:
    torch.manual_seed(0)
    residual = kw.pop("residual", {"smear": {"init": 0.5, **(smear or {})}})
    model = GPT(validate(GPTConfig(**{**BASE, "residual": residual, **kw}))).double().eval()
    with torch.no_grad():  # a gate that depends on the token: a wrong slice or a shifted gate shows
        for name, p in model.named_parameters():
            if name.endswith("smear.gate"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)) * 3)
    return model


def _idx(T: int = 20, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))  # no end-of-document token


def _sigmoid(z: float) -> float:
    return 1 / (1 + math.exp(-z))


def test_smear_is_its_formula_on_a_hand_example() -> None:
    """g = 2 of d = 3 channels, w = (0.5, −1), λ = 0.3: token t adds λ·σ(w·x_t[:2])·x_{t−1}; the first adds nothing."""
    smear = Smear(GPTConfig(vocab_size=V, n_layer=1, d_model=3, n_head=1), gate_channels=2).double()
    with torch.no_grad():
        smear.gate.copy_(torch.tensor([0.5, -1.0]))
        smear.lam.fill_(0.3)
    x = torch.tensor([[[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [-1.0, 0.0, 2.0]]], dtype=torch.float64)
    s1, s2 = _sigmoid(0.5 * 4 - 5), _sigmoid(0.5 * -1 - 0)  # the gate reads the token's own first channels
    want = torch.tensor([[[1.0, 2.0, 3.0],
                          [4 + 0.3 * s1 * 1, 5 + 0.3 * s1 * 2, 6 + 0.3 * s1 * 3],
                          [-1 + 0.3 * s2 * 4, 0 + 0.3 * s2 * 5, 2 + 0.3 * s2 * 6]]], dtype=torch.float64)
    torch.testing.assert_close(smear.embed(x, torch.zeros(1, 3, dtype=torch.long), None, None), want, rtol=0,
                               atol=1e-12)
    doc = torch.tensor([[0, 1, 1]])  # a document starts at token 1: it reads nothing before it
    want[:, 1] = x[:, 1]
    smear.cut = True
    torch.testing.assert_close(smear.embed(x, torch.zeros(1, 3, dtype=torch.long), None, doc), want, rtol=0,
                               atol=1e-12)


def _smeared(model: GPT, e: torch.Tensor) -> torch.Tensor:
    """The formula written out on the embeddings e (B, T, d)."""
    smear = model.residual.options["smear"]
    g = torch.sigmoid(e[..., :smear.gate.numel()] @ smear.gate)[..., None]
    prev = torch.nn.functional.pad(e, (0, 0, 1, 0))[:, :-1]
    return e + smear.lam * g * prev


def test_the_model_smears_its_embeddings_before_the_norm_and_x0_carries_them() -> None:
    """embed_norm on, residual=[smear,x0]: layer 0 reads N(smear(wte(idx))) and layer 1 adds λ_1 times the same x0."""
    model = _model(residual={"smear": {"init": 0.5}, "x0": {"init": 0.3}}, embed_norm=True)
    idx = _idx()
    ins, outs = [], []
    hooks = [b.register_forward_pre_hook(lambda m, a: ins.append(a[0])) for b in model.h]
    hooks += [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in model.h]
    with torch.no_grad():
        model(idx)
        x0 = model.ln_e(_smeared(model, model.wte(idx)))
    for h in hooks:
        h.remove()
    torch.testing.assert_close(ins[0], x0, rtol=1e-12, atol=1e-12)
    lam = model.residual.options["x0"].lambdas[1]  # 0.3 (a float32 number, then float64)
    torch.testing.assert_close(ins[1], outs[0] + lam * x0, rtol=1e-12, atol=1e-12)


def test_the_records_init_is_the_standard_model_and_then_learns() -> None:
    """init=0 (the record's λ): the standard model's logits exactly; λ gets a gradient at step 0, the gate (its
    gradient carries λ) from the next step on."""
    smear = _model(residual={"smear": {"init": 0.0}})
    standard = _model(residual={})
    missing, unexpected = smear.load_state_dict(standard.state_dict(), strict=False)
    assert not unexpected and set(missing) == {"residual.options.smear.gate", "residual.options.smear.lam"}
    idx = _idx()
    with torch.no_grad():
        torch.testing.assert_close(smear(idx), standard(idx), rtol=0, atol=0)
    opt = torch.optim.SGD(smear.parameters(), lr=0.1)
    for step in range(2):
        opt.zero_grad()
        smear.train()(idx, targets=idx.roll(-1, 1)).backward()
        gate, lam = (smear.residual.options["smear"].get_parameter(n).grad for n in ("gate", "lam"))
        assert lam.abs() > 0 and (gate.abs().sum() > 0) == (step > 0)
        opt.step()


CACHED = {
    "rope": {},
    "learned positions+embed_norm": {"position": {"name": "learned"}, "embed_norm": True},
    "doc_mask": {"eod_id": EOD, "attention": {"name": "mha", "doc_mask": True}},
    "with x0, unet, value_embed": {"residual": {"smear": {"init": 0.5}, "x0": {"init": 0.3}, "unet": {},
                                                "value_embed": {"tables": 1}}},
}


@pytest.mark.parametrize("case", sorted(CACHED))
def test_cached_generation_gives_the_full_forward(case: str) -> None:
    """A prompt of 7, then 4 tokens at once, then one at a time: the first token of each forward reads the last
    embedding of the one before from the cache. (Greedy generation over every residual option: test_generate.py.)"""
    model = _model(**CACHED[case])
    idx = _idx(T=24)
    if "eod_id" in CACHED[case]:
        idx[:, [3, 6, 10, 15]] = EOD  # documents start inside the prompt and at the first token of the block of 4
        # and of the single steps (positions 4, 7, 11, 16)
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(len(model.h))
        steps = [model(idx[:, :7], cache=cache), model(idx[:, 7:11], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(11, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    assert cache.layers[0].inputs["smear"].shape == (2, 1, 32)


def test_its_weights_are_adamws_under_muon() -> None:
    """The gate (g,) and λ are a vector and a scalar: the no-decay group (`rest`), AdamW under optim=muon."""
    model = build_model(compose(["residual=smear", "optim=muon", "model.vocab_size=50"]))
    mine = {id(p) for k, p in model.named_parameters() if ".smear." in k}
    roles = {id(p): g["role"] for g in param_groups(model, 0.1, by_role=True) for p in g["params"]}
    assert len(mine) == 2 and {roles[i] for i in mine} == {"rest"}
    opt = OPTIMIZERS["muon"](param_groups(model, 0.1, by_role=True))
    assert {g["kind"] for g in opt.param_groups for p in g["params"] if id(p) in mine} == {"adamw"}
    assert not any(isinstance(m, nn.Linear) for m in model.residual.modules())


@pytest.mark.parametrize("overrides,message", [
    (["residual.smear.gate_channels=0"], r"residual\.smear\.gate_channels=0 must be an integer >= 1"),
    (["residual.smear.gate_channels=65", "model.d_model=64"],
     r"residual\.smear\.gate_channels=65: .* model\.d_model=64 has fewer; use 1 \.\. 64"),
])
def test_bad_smear_input_is_named_before_training(overrides: list[str], message: str) -> None:
    assert_refused(["residual=smear", *overrides], message)


def test_the_yaml_composes() -> None:
    from lmlab.run.checks import check_config

    cfg = compose(["residual=[x0,smear]"])
    assert cfg.residual == {"x0": {"init": 0.0}, "smear": {"gate_channels": 12, "init": 0.1}}
    check_config(cfg)
