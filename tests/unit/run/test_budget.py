"""budget.flops|tokens|tokens_per_param|wall (lmlab.run.budget): each variant's steps from its own FLOPs per token, the
rule checked by hand; bad budgets refused by key before training; a run records its budget and what it spent."""

from __future__ import annotations

import pytest

from lmlab import compose
from lmlab.config import arch_config
from lmlab.model.gpt import validate
from lmlab.run import budget
from lmlab.run.checks import check_config

V, L, D, T, B = 64, 4, 128, 128, 8  # the tiny model with a 64-token vocabulary, 8 sequences per step


def _apply(*overrides: str):
    cfg = compose([f"data.batch_size={B}", *overrides])
    model = validate(arch_config(cfg, vocab_size=V))
    return cfg, model, budget.apply(cfg, model)


def _by_hand(ffn_params_per_layer: int) -> int:
    """Train FLOPs per token of the tiny GPT: 6·N + 6·L·T·2d, N = L·(4d² attention + the FFN) + V·d (tied head)."""
    n = L * (4 * D * D + ffn_params_per_layer) + V * D
    return 6 * n + 6 * L * T * 2 * D


def test_flops_budget_gives_each_variant_its_own_steps() -> None:
    flops = 1e13
    cfg, model, mlp = _apply("budget.flops=1e13")
    f_mlp = _by_hand(2 * D * 4 * D)  # W1 d x 4d and W2 4d x d, no biases
    assert mlp["flops_per_token"] == f_mlp == 5_554_176
    assert mlp["tokens_per_step"] == B * T == 1024
    assert mlp["steps"] == cfg.trainer.max_steps == int(flops // (f_mlp * 1024)) == 1758
    cfg, model, swiglu = _apply("budget.flops=1e13", "ffn=swiglu")
    h = model.ffn_hidden
    f_swiglu = _by_hand(3 * D * h)  # gate, up and down
    assert swiglu["flops_per_token"] == f_swiglu and swiglu["steps"] == int(flops // (f_swiglu * 1024))
    cfg, model, wide = _apply("budget.flops=1e13", "model.d_model=256")  # ~4x the FLOPs: ~1/4 of the steps
    assert wide["steps"] < mlp["steps"] / 3.5
    cfg, model, window = _apply("budget.flops=1e13", "attention.window=32")  # windows cost W, not T
    assert window["flops_per_token"] == f_mlp - 6 * L * (T - 32) * 2 * D


def test_token_budgets_and_the_world_size() -> None:
    cfg, _, got = _apply("budget.tokens=1e6", "trainer.devices=2", "trainer.accumulate_grad_batches=3")
    assert got["tokens_per_step"] == B * T * 2 * 3 and cfg.trainer.max_steps == 1_000_000 // (B * T * 6) == 162
    cfg, model, got = _apply("budget.tokens_per_param=20")
    assert got["n_matmul"] == L * 12 * D * D + V * D and cfg.trainer.max_steps == 20 * got["n_matmul"] // (B * T)
    cfg, _, got = _apply("budget.wall=90")
    assert got == {"kind": "wall", "value": 90.0, "steps": None} and cfg.trainer.max_time == "00:00:01:30"
    assert cfg.trainer.max_steps == 600  # the schedule keeps its length
    cfg, _, got = _apply()
    assert got is None and cfg.trainer.max_steps == 600


@pytest.mark.parametrize("overrides, match", [
    (["budget.flops=1e12", "budget.tokens=1e6"], r"budget.flops=1e\+12 and budget.tokens=1e\+06 are set together"),
    (["budget.tokens=0"], r"budget.tokens=0 must be a number > 0"),
    (["budget.flops=-5"], r"budget.flops=-5 must be a number > 0"),
    (["budget.wall=soon"], r"budget.wall='soon' must be a number > 0"),
    (["+budget.steps=10"], r"budget.steps is not a budget; choose one of \['budget.flops'"),
])
def test_bad_budgets_are_refused_by_key_before_training(overrides, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_config(compose(overrides))


def test_a_budget_below_one_step_is_refused() -> None:
    with pytest.raises(ValueError, match=r"budget.flops=1e\+06 buys no optimizer step: one step costs"):
        _apply("budget.flops=1e6")


def test_a_wall_budget_is_lightnings_max_time_in_whole_seconds() -> None:
    from lightning.pytorch.callbacks import Timer

    assert [budget.max_time(s) for s in (0.2, 9.6, 300, 90061)] == ["00:00:00:01", "00:00:00:10", "00:00:05:00",
                                                                    "01:01:01:01"]
    assert Timer(duration=budget.max_time(300)).time_remaining() == 300  # the form Lightning's Timer reads


def test_spent_records_the_budget() -> None:
    got = budget.spent({"kind": "tokens"}, {"tokens": 2048, "wall_time_s": 3.0}, 1000)
    assert got == {"budget": {"kind": "tokens"}, "flops_per_token": 1000,
                   "budget_spent": {"tokens": 2048, "flops": 2_048_000, "wall_s": 3.0}}


def test_depth_width_keeps_the_matmul_weights_of_its_reference() -> None:
    from lmlab.run.budget import equal_flops_width

    assert [equal_flops_width(n, 4, 128) for n in (1, 2, 4, 8, 16)] == [256, 184, 128, 88, 64]
    for n_layer in (1, 2, 4, 8, 16):
        cfg = compose(["experiment=depth_width", f"model.n_layer={n_layer}"])
        d = cfg.model.d_model
        assert d == equal_flops_width(n_layer, 4, 128) and d % cfg.model.n_head == 0
        assert abs(12 * n_layer * d * d / (12 * 4 * 128 * 128) - 1) < 0.06  # within 6% of the reference's weights
        assert cfg.budget.flops == 5e12
