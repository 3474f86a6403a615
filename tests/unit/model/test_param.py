"""The parametrisation axis: param=sp is today's model; param=mup's init scales, attention scale, output multiplier
and per-group learning rates by formula; equal to SP at the base width; refused by key where lmlab does not define
it; and the coordinate check at tiny widths (activations' change after a few Adam steps flat in the width under µP,
growing under SP)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.run.checks import check_config
from lmlab.run.lit import configure_optimization

BASE = dict(vocab_size=64, n_layer=2, n_head=2, max_seq_len=32, position={"name": "learned"})


def _gpt(width: int, param: dict, seed: int = 0, **kw) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(d_model=width, param=param, **{**BASE, **kw}))


MUP = {"name": "mup", "base_width": 32, "output_mult": 1.0}


@pytest.mark.parametrize("tie", [True, False])
def test_mup_init_is_sp_times_the_width_factor(tie: bool) -> None:
    """Same seed, same draws: every hidden Linear weight is SP's · m^(-1/2), m = d_model/base_width; embeddings (a
    tied head is one), gains and an untied head are SP's (the mup package's MuReadout: var 1/fan_in times √m when
    rescaled, constant in the width; only its output multiplier 1/m scales the logits)."""
    sp, mup = _gpt(128, {"name": "sp"}, tie_embeddings=tie), _gpt(128, MUP, tie_embeddings=tie)
    m = 128 / 32
    hidden = {id(mod.weight) for blk in mup.h for mod in blk.modules() if isinstance(mod, nn.Linear)}
    for (name, p), q in zip(mup.named_parameters(), sp.parameters()):
        factor = m ** -0.5 if id(p) in hidden else 1.0
        torch.testing.assert_close(p, q * factor, rtol=0, atol=0, msg=name)
    assert torch.equal(mup.lm_head.weight, sp.lm_head.weight)
    std = mup.h[0].mlp.c_fc.weight.std().item()  # N(0, 0.02) at the base width, 0.02·sqrt(32/128) here
    assert std == pytest.approx(0.02 * math.sqrt(32 / 128), rel=0.05)


def test_mup_attention_scale_and_output_multiplier() -> None:
    """1/√d becomes √d_base/d (d = head dim, d_base = base_width/n_head); the logits are (output_mult/m)·W·h."""
    model = _gpt(128, {**MUP, "output_mult": 2.0})
    hd, hd_base = 128 // 2, 32 // 2
    assert model.h[0].attn.scale == pytest.approx(math.sqrt(hd_base) / hd)
    assert _gpt(128, {"name": "sp"}).h[0].attn.scale == pytest.approx(1 / math.sqrt(hd))
    idx = torch.randint(0, 64, (2, 8))
    seen = {}
    model.ln_f.register_forward_hook(lambda mod, i, o: seen.setdefault("h", o))
    logits = model(idx)
    torch.testing.assert_close(logits, model.lm_head(seen["h"]) * (2.0 / 4), rtol=1e-6, atol=1e-6)


def test_mup_at_the_base_width_is_sp() -> None:
    """m = 1: the same weights, logits and (after the same steps) learning rates as param=sp."""
    sp, mup = _gpt(32, {"name": "sp"}), _gpt(32, MUP)
    idx = torch.randint(0, 64, (2, 8))
    for p, q in zip(sp.parameters(), mup.parameters()):
        assert torch.equal(p, q)
    assert torch.equal(sp(idx), mup(idx))
    opt = configure_optimization(mup, {"name": "adamw", "lr": 0.01, "weight_decay": 0.1}, {"name": "constant"}, 10)
    assert {g["lr"] for g in opt["optimizer"].param_groups} == {0.01}


@pytest.mark.parametrize("name", ["adamw", "lion", "schedulefree"])
def test_mup_learning_rates_per_group(name: str) -> None:
    """Hidden matrices lr·base_width/d_model, the readout and the rest lr; the schedule multiplies each group's own."""
    model = _gpt(128, MUP, tie_embeddings=False)
    out = configure_optimization(model, {"name": name, "lr": 0.01, "weight_decay": 0.1},
                                 {"name": "constant", "warmup_steps": 2}, 10)
    opt = out["optimizer"]
    lrs = {g["role"]: g["lr"] for g in opt.param_groups}
    assert lrs == pytest.approx({"hidden": 0.01 * 32 / 128 / 2, "readout": 0.01 / 2, "rest": 0.01 / 2})  # warmup 1/2
    hidden = next(g for g in opt.param_groups if g["role"] == "hidden")["params"]
    assert {id(p) for p in hidden} == {id(mod.weight) for blk in model.h for mod in blk.modules()
                                       if isinstance(mod, nn.Linear)}
    sp = configure_optimization(_gpt(128, {"name": "sp"}), {"name": name, "lr": 0.01, "weight_decay": 0.1},
                                {"name": "constant"}, 10)["optimizer"]
    assert len(sp.param_groups) == 2 and "role" not in sp.param_groups[0]  # SP: the groups of every earlier run


@pytest.mark.parametrize(("overrides", "words"), [
    (["param=mup", "block=gau"], ["param=mup with block='gau'", "block=transformer"]),
    (["param=mup", "init=xavier"], ["param=mup with init='xavier'", "init=gpt2"]),
    (["param=mup", "param.base_width=90"], ["param.base_width=90", "model.n_head=4"]),
    (["param=mup", "optim=sgd"], ["param=mup with optim=sgd", "'adamw'", "'schedulefree'"]),
    (["param=mup", "param.base_width=0"], ["param.base_width=0"]),
])
def test_refused_before_training_naming_the_key(overrides: list[str], words: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        check_config(compose(overrides))
    for w in words:
        assert w in str(err.value), str(err.value)


def _change_after_steps(param: dict, width: int, steps: int = 5, lr: float = 1e-2, optim: str = "adamw",
                        **optim_keys) -> float:
    """RMS of the last block's output change (x_t − x_0) on a fixed batch after `steps` steps of `optim` at `lr`."""
    model = _gpt(width, param, norm={"name": "layer"})
    spec = {"name": optim, "lr": lr, "weight_decay": 0.0, **({"adam_lr": lr} if optim == "muon" else {}), **optim_keys}
    opt = configure_optimization(model, spec, {"name": "constant", "warmup_steps": 0}, steps)["optimizer"]
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 64, (8, 32), generator=g), torch.randint(0, 64, (8, 32), generator=g)
    acts = {}
    model.h[-1].register_forward_hook(lambda mod, i, o: acts.__setitem__("x", o.detach()))
    with torch.no_grad():
        model(x)
    x0 = acts["x"]
    for _ in range(steps):
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    with torch.no_grad():
        model(x)
    return (acts["x"] - x0).pow(2).mean().sqrt().item()


def test_coordinate_check_flat_under_mup_growing_under_sp() -> None:
    """The µP paper's coordinate check at widths 32 .. 128 (base 32): after 5 AdamW steps at the same lr, the
    activations' change grows with the width under SP (measured ~13x from 32 to 128) and stays put under µP
    (measured 0.87x)."""
    sp = [_change_after_steps({"name": "sp"}, w) for w in (32, 64, 128)]
    mup = [_change_after_steps(MUP, w) for w in (32, 64, 128)]
    assert sp[0] == pytest.approx(mup[0])  # the base width: the same model
    assert sp[2] / sp[0] > 4 and sp[1] / sp[0] > 1.5
    assert 0.7 < mup[2] / mup[0] < 1.3 and 0.7 < mup[1] / mup[0] < 1.3


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_mup_with_muon_takes_the_spectral_conditions_hidden_lr(adjust: str) -> None:
    """param=mup with optim=muon: the Muon groups' lr is lr·m^(-1/2) under match_rms_adamw (its s ∝ √width) and lr
    under original (s width-free), not Adam's lr/m; the readout and the rest (AdamW) take µP's Adam rules. One step's
    spectral norm of a hidden matrix is then the same at every width (within bf16's Newton–Schulz, 10%)."""
    norms = []
    for width in (32, 64, 128):
        model = _gpt(width, MUP, tie_embeddings=False)
        out = configure_optimization(model, {"name": "muon", "lr": 0.01, "adam_lr": 0.01, "weight_decay": 0.0,
                                             "adjust_lr_fn": adjust}, {"name": "constant"}, 10)
        opt, m = out["optimizer"], width / 32
        want = 0.01 * (m ** -0.5 if adjust == "match_rms_adamw" else 1.0)
        assert [g["lr"] for g in opt.param_groups if g["kind"] == "muon"] == [pytest.approx(want)]
        assert {g["role"]: g["lr"] for g in opt.param_groups if g["kind"] == "adamw"} == {"readout": 0.01,
                                                                                        "rest": 0.01}
        w = model.h[0].mlp.c_fc.weight
        before = w.detach().clone()
        torch.manual_seed(0)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        norms.append(torch.linalg.matrix_norm(w.detach() - before, ord=2).item())
    assert max(norms) / min(norms) < 1.1, norms


def test_coordinate_check_flat_under_mup_with_muon() -> None:
    """The coordinate check with Muon (match_rms_adamw, hidden lr by the spectral rule): flat in the width under µP
    where SP + Muon grows (measured: 1.00 / 1.04 / 1.05 under µP at widths 32 / 64 / 128, 1.00 / 1.41 / 2.25 under
    SP; adjust_lr_fn=original with its unscaled lr gives µP's 1.04 / 1.04 too)."""
    sp = [_change_after_steps({"name": "sp"}, w, lr=3e-3, optim="muon") for w in (32, 64, 128)]
    mup = [_change_after_steps(MUP, w, lr=3e-3, optim="muon") for w in (32, 64, 128)]
    assert sp[0] == pytest.approx(mup[0])
    assert sp[2] / sp[0] > 2
    assert 0.7 < mup[2] / mup[0] < 1.3 and 0.7 < mup[1] / mup[0] < 1.3, mup
