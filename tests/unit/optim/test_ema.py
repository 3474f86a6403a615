"""optim.ema: the weight EMA (lmlab.optim.ema) by hand against its closed form, its start, its state round trip, the
swap that evaluates it and gives the live weights back bit for bit, and the refusals before training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmlab.optim import validate_optim
from lmlab.optim.ema import WeightEMA

ADAMW, CONSTANT = {"name": "adamw"}, {"name": "constant"}


def _steps(model: nn.Module, ema: WeightEMA, k: int) -> list[dict[str, torch.Tensor]]:
    """k "optimizer steps" that set every parameter to new random values; the values before the first and after each."""
    seen = [{n: p.detach().clone() for n, p in model.named_parameters()}]
    for t in range(1, k + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p))
        ema.update(model, step=t)
        seen.append({n: p.detach().clone() for n, p in model.named_parameters()})
    return seen


def test_k_updates_equal_the_closed_form_weighted_sum() -> None:
    """ema_k = d^k·θ_0 + Σ_{t=1..k} (1 − d)·d^(k−t)·θ_t over the weights of every step."""
    model, d, k = nn.Linear(3, 2), 0.9, 5
    ema = WeightEMA(model, decay=d)
    seen = _steps(model, ema, k)
    for name in ("weight", "bias"):
        expected = d ** k * seen[0][name] + sum((1 - d) * d ** (k - t) * seen[t][name] for t in range(1, k + 1))
        torch.testing.assert_close(ema.weights[name], expected, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(ema.weights[name], seen[k][name])  # an average, not the last weights


def test_a_scalar_by_hand() -> None:
    """θ = 0, then 1, 2, 3 with d = 0.5: 0.5, 1.25, 2.125."""
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(()))
    ema = WeightEMA(model, decay=0.5)
    got = []
    for t, value in enumerate((1.0, 2.0, 3.0), start=1):
        with torch.no_grad():
            model.w.fill_(value)
        ema.update(model, step=t)
        got.append(float(ema.weights["w"]))
    assert got == [0.5, 1.25, 2.125]


def test_until_start_the_ema_is_the_weights_then_it_averages_from_there() -> None:
    model = nn.Module()
    model.w = nn.Parameter(torch.zeros(()))
    ema = WeightEMA(model, decay=0.5, start=2)
    got = []
    for t, value in enumerate((1.0, 2.0, 3.0, 4.0), start=1):
        with torch.no_grad():
            model.w.fill_(value)
        ema.update(model, step=t)
        got.append(float(ema.weights["w"]))
    assert got == [1.0, 2.0, 2.5, 3.25]  # a copy through step 2, then 0.5·2 + 0.5·3, 0.5·2.5 + 0.5·4


def test_the_average_is_fp32_over_bf16_weights() -> None:
    model = nn.Linear(4, 4).to(torch.bfloat16)
    ema = WeightEMA(model, decay=0.99)
    assert {v.dtype for v in ema.weights.values()} == {torch.float32}
    w0 = model.weight.detach().float().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model, step=1)
    w1 = model.weight.detach().float()
    torch.testing.assert_close(ema.weights["weight"], 0.99 * w0 + 0.01 * w1, rtol=0, atol=1e-6)
    # ≈ w0 + 0.01: a move bf16 would round away on most entries (its spacing near 0.5 is 2^-9), fp32 keeps it
    assert not torch.equal(ema.weights["weight"].bfloat16().float(), ema.weights["weight"])
    with ema.applied(model):  # evaluated in the model's dtype
        assert model.weight.dtype == torch.bfloat16 and torch.equal(model.weight, ema.weights["weight"].bfloat16())
    assert torch.equal(model.weight.float(), w1)


def test_tied_weights_are_averaged_once() -> None:
    model = nn.Module()
    model.a = nn.Linear(3, 3, bias=False)
    model.b = nn.Linear(3, 3, bias=False)
    model.b.weight = model.a.weight
    assert set(WeightEMA(model, decay=0.9).weights) == {"a.weight"}


def test_applied_evaluates_the_ema_and_gives_the_live_weights_back_exactly() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ema = WeightEMA(model, decay=0.8)
    _steps(model, ema, 3)
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(4, 3)
    with ema.applied(model):
        for n, p in model.named_parameters():
            assert torch.equal(p.detach(), ema.weights[n]), n
        out = model(x)
    torch.testing.assert_close(out, x @ ema.weights["weight"].T + ema.weights["bias"], rtol=1e-6, atol=1e-6)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), live[n]), n  # bit for bit: a resume-exact run validates through this


def test_the_state_round_trips_and_goes_on_identically() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    ema = WeightEMA(model, decay=0.7)
    _steps(model, ema, 2)
    saved = ema.state_dict()
    assert all(v.device.type == "cpu" for v in saved.values())
    other = WeightEMA(model, decay=0.7)  # as a resume builds it: from the live weights, then the checkpoint's
    other.load_state_dict(saved)
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update(model, step=3)
    other.update(model, step=3)
    for n in ema.weights:
        assert torch.equal(ema.weights[n], other.weights[n]), n


def test_a_state_of_another_model_is_refused_by_name() -> None:
    ema = WeightEMA(nn.Linear(3, 2), decay=0.5)
    with pytest.raises(ValueError, match="bias"):
        ema.load_state_dict({"weight": torch.zeros(2, 3)})
    with pytest.raises(ValueError, match="weight"):
        ema.load_state_dict({"weight": torch.zeros(3, 3), "bias": torch.zeros(2)})


@pytest.mark.parametrize("ema", [-0.1, 1.0, 1.5, "x"])
def test_a_decay_outside_zero_one_is_refused_naming_the_key(ema) -> None:
    with pytest.raises(ValueError, match=r"optim\.ema=.*\[0, 1\)"):
        validate_optim({**ADAMW, "ema": ema}, CONSTANT)


def test_a_negative_start_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"optim\.ema_start=-1"):
        validate_optim({**ADAMW, "ema": 0.9, "ema_start": -1}, CONSTANT)


def test_schedulefree_and_fsdp2_are_refused_with_an_ema_and_taken_without() -> None:
    with pytest.raises(ValueError, match=r"optim\.ema=0\.9 with optim=schedulefree"):
        validate_optim({"name": "schedulefree", "ema": 0.9}, CONSTANT)
    with pytest.raises(ValueError, match=r"optim\.ema=0\.9 with trainer=fsdp2"):
        validate_optim({**ADAMW, "ema": 0.9}, CONSTANT, "FSDP2Strategy")
    with pytest.raises(ValueError, match=r"optim\.ema=0\.9 with trainer=fsdp:"):
        validate_optim({**ADAMW, "ema": 0.9}, CONSTANT, "fsdp")
    validate_optim({"name": "schedulefree", "ema": 0.0}, CONSTANT)  # off: as before
    validate_optim({**ADAMW, "ema": 0.0}, CONSTANT, "FSDP2Strategy")
    validate_optim({**ADAMW, "ema": 0.9}, CONSTANT, "DDPStrategy")  # DDP: every rank holds the same weights


def test_the_loop_yaml_defaults_to_off_and_composes_into_every_optimizer() -> None:
    from lmlab import compose
    from lmlab.optim import OPTIMIZERS, optimizer_spec

    for name in sorted(OPTIMIZERS):
        optim = compose([f"optim={name}"]).optim
        assert optim.ema == 0.0 and optim.ema_start == 0, name
        assert "ema" not in optimizer_spec(dict(optim)), name  # the loop's key, never the optimizer's


@pytest.mark.parametrize("overrides, match", [
    (["optim.ema=1.0"], r"optim\.ema=1\.0 must be a float in \[0, 1\)"),
    (["optim.ema=-0.5"], r"optim\.ema=-0\.5 must be a float in \[0, 1\)"),
    (["optim=schedulefree", "optim.ema=0.99"], r"optim\.ema=0\.99 with optim=schedulefree"),
])
def test_the_run_s_checks_refuse_them_before_training(overrides, match) -> None:
    from lmlab import compose
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=match):
        check_config(compose(overrides))
    check_config(compose([o for o in overrides if not o.startswith("optim.ema")]))  # the same run without: taken
