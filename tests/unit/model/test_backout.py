"""residual=backout (the GPT-2 speedrun's record 40): the final norm reads x_L − λ·x_{ℓ+1}, the stream after layer ℓ
(read back from the blocks); the default layer; init=0 the standard model; cached generation equal to the full
forward; the optimizer roles; refusals by key. Causality and training: test_residual_options.py, over the options."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lmlab import build_model, compose
from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.gpt import GPT, validate
from lmlab.optim import OPTIMIZERS, param_groups
from tests.unit.model.options import assert_refused

V = 40
BASE = dict(vocab_size=V, n_layer=4, d_model=32, n_head=4, max_seq_len=32, position={"name": "rope"},
            norm={"name": "rms"})


def _model(backout: dict | None = None, **kw) -> GPT:
    torch.manual_seed(0)
    residual = kw.pop("residual", {"backout": backout or {}})
    return GPT(validate(GPTConfig(**{**BASE, "residual": residual, **kw}))).double().eval()


def _idx(T: int = 20, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("backout", [{}, {"layer": 0, "init": -0.7}])
def test_the_final_norm_reads_the_last_stream_minus_lambda_times_layer_ls(backout: dict) -> None:
    """4 layers: ℓ = ⌊8/3⌋ = 2 by default; the logits are W·N(x_4 − λ·x_{ℓ+1}), the blocks' outputs read back."""
    model = _model(backout)
    option = model.residual.options["backout"]
    layer, lam = backout.get("layer", 2), option.lam.detach()  # init as a float32 number (then float64)
    assert option.layer == layer and float(lam) == pytest.approx(backout.get("init", 0.5))
    outs = []
    hooks = [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in model.h]
    idx = _idx()
    with torch.no_grad():
        logits = model(idx)
    for h in hooks:
        h.remove()
    want = F.linear(model.ln_f(outs[-1] - lam * outs[layer]), model.lm_head.weight)
    torch.testing.assert_close(logits, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("n_layer,layer", [(2, 0), (3, 1), (4, 2), (6, 4), (11, 7), (12, 8)])
def test_the_default_layer_is_two_thirds_of_the_stack(n_layer: int, layer: int) -> None:
    """⌊2L/3⌋, at most L − 2: the record's layer 8 of 12 (record 40) and 7 of 11 (record 62)."""
    assert _model(n_layer=n_layer).residual.options["backout"].layer == layer


def test_init_zero_is_the_standard_model_and_lambda_learns() -> None:
    backout, standard = _model({"init": 0.0}), _model(residual={})
    missing, unexpected = backout.load_state_dict(standard.state_dict(), strict=False)
    assert not unexpected and missing == ["residual.options.backout.lam"]
    idx = _idx()
    with torch.no_grad():
        torch.testing.assert_close(backout(idx), standard(idx), rtol=0, atol=0)
    backout.train()(idx, targets=idx.roll(-1, 1)).backward()
    assert backout.residual.options["backout"].lam.grad.abs() > 0


@pytest.mark.parametrize("residual", [{"backout": {}}, {"scaled": {"stream": True}, "x0": {"init": 0.3},
                                                        "unet": {}, "backout": {"layer": 1}}])
def test_cached_generation_gives_the_full_forward(residual: dict) -> None:
    model = _model(residual=residual)
    idx = _idx(T=24)
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(len(model.h))
        steps = [model(idx[:, :7], cache=cache), model(idx[:, 7:11], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(11, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


def test_its_weight_is_adamws_under_muon() -> None:
    model = build_model(compose(["residual=backout", "optim=muon", "model.vocab_size=50"]))
    lam = model.residual.options["backout"].lam
    roles = {id(p): g["role"] for g in param_groups(model, 0.1, by_role=True) for p in g["params"]}
    assert roles[id(lam)] == "rest"
    opt = OPTIMIZERS["muon"](param_groups(model, 0.1, by_role=True))
    assert next(g["kind"] for g in opt.param_groups if any(p is lam for p in g["params"])) == "adamw"


@pytest.mark.parametrize("overrides,message", [
    (["residual.backout.layer=3", "model.n_layer=4"],
     r"residual\.backout\.layer=3 must be a layer before the last, 0 \.\. 2 \(model\.n_layer=4\), or null"),
    (["residual.backout.layer=-1"], r"residual\.backout\.layer=-1 must be an integer >= 0 or null"),
    (["model.n_layer=1"], r"residual=backout .* model\.n_layer=1 has no layer before the last"),
])
def test_bad_backout_input_is_named_before_training(overrides: list[str], message: str) -> None:
    assert_refused(["residual=backout", *overrides], message)


def test_the_yaml_composes_to_the_records_defaults() -> None:
    from lmlab.run.checks import check_config

    cfg = compose(["residual=[scaled,x0,backout]"])
    assert cfg.residual["backout"] == {"layer": None, "init": 0.5}
    check_config(cfg)
