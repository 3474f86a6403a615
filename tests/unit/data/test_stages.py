"""lmlab.data.stages: the batch and the length by step — stages checked by key, the sampler's batches against a
brute-force enumeration (every rank's slice disjoint, together every index once, from any step: a resume), and the
tokens and FLOPs a run, a budget and a target count through them."""

from __future__ import annotations

import pytest

from lmlab.data import stages


def test_a_stage_starts_at_its_fraction_of_max_steps() -> None:
    batch = stages.check("data.batch_schedule", [[0, 8], [0.33, 16], [0.66, 24]])
    assert stages.starts(batch, 100) == [0, 33, 66]
    assert [stages.at(batch, s, 100, 1) for s in (0, 32, 33, 65, 66, 99)] == [8, 8, 16, 16, 24, 24]
    assert stages.at(None, 5, 100, 7) == 7
    assert stages.samples_before(40, batch, 100, 1) == 33 * 8 + 7 * 16


@pytest.mark.parametrize("world,accumulate,start", [(1, 1, 0), (2, 1, 0), (2, 2, 3), (3, 1, 5)])
def test_the_batches_are_the_enumerated_global_batches_sliced_by_rank(world, accumulate, start) -> None:
    """Global batch of step s: the next B(s)·world·accumulate indices, in `accumulate` micro-batches, rank r taking
    slice r of each; from step `start` (a resume) the sampler gives exactly the uninterrupted run's batches."""
    batch, max_steps = stages.check("k", [[0, 2], [0.5, 3]]), 8
    expected, first = {}, 0
    for step in range(max_steps):
        b = stages.at(batch, step, max_steps, 1)
        for m in range(accumulate):
            for r in range(world):
                expected[step, m, r] = list(range(first + r * b, first + (r + 1) * b))
            first += world * b
    for r in range(world):
        sampler = iter(stages.ScheduledBatches(start_step=start, max_steps=max_steps, stages=batch, batch_size=1,
                                               rank=r, world_size=world, accumulate=accumulate))
        for step in range(start, max_steps):
            for m in range(accumulate):
                assert next(sampler) == expected[step, m, r]


@pytest.mark.parametrize("key,stages_,message", [
    ("data.batch_schedule", [[0.1, 4]], r"start at 0 and increase, below 1"),
    ("data.batch_schedule", [[0, 4], [0.5, 8], [0.4, 16]], r"start at 0 and increase"),
    ("data.batch_schedule", [[0, 0]], r"has the value 0"),
    ("data.batch_schedule", [[0, 4.5]], r"each stage is \[fraction, value\]"),
    ("data.batch_schedule", 8, r"must be a list of \[fraction of trainer.max_steps, value\] stages"),
    ("data.seq_schedule", [[0, 48]], r"48, which does not divide model.max_seq_len=64"),
    ("data.seq_schedule", [[0, 128]], r"128, past the model's context \(model.max_seq_len=64\)"),
])
def test_bad_stages_are_named(key, stages_, message) -> None:
    with pytest.raises(ValueError, match=message):
        stages.check(key, stages_, **({"limit": 64, "divides": 64} if key == "data.seq_schedule" else {}))


def test_bad_schedules_are_refused_before_training() -> None:
    from lmlab import compose
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=r"data.seq_schedule has 300, past the model's context"):
        check_config(compose(["data.seq_schedule=[[0,300]]"]))
    with pytest.raises(ValueError, match=r"data.batch_schedule with head=mlm"):
        check_config(compose(["data.batch_schedule=[[0,4]]", "head=mlm"]))


def test_the_tokens_and_flops_to_a_target_count_through_the_stages() -> None:
    from lmlab.record.targets import to_target

    stages = [{"from_step": 0, "tokens_per_step": 100, "flops_per_token": 10.0},
              {"from_step": 4, "tokens_per_step": 300, "flops_per_token": 20.0}]
    summary = {"val_curve": [(2, 3.0), (6, 2.0)], "steps": 6, "tokens": 1000, "stages": stages}
    out = to_target({}, summary, 2.5, 10.0)  # crossed at step 4 + 0 = 4.0: halfway from 2 to 6
    assert out["steps_to_target"] == 4.0
    assert out["tokens_to_target"] == 400 and out["flops_to_target"] == 4000
    out = to_target({}, summary, 2.25, 10.0)  # step 5: 400 + 300 tokens, 4000 + 300·20 FLOPs
    assert out["tokens_to_target"] == 700 and out["flops_to_target"] == 10000


def test_a_token_budget_under_a_batch_schedule_buys_the_steps_the_stages_allow(tmp_path) -> None:
    """budget.tokens over stages that scale with the steps: the most S whose S steps (the first half at batch 4, the
    rest at 8, of 32 tokens) stay within 2000 tokens: S = 10 costs 5·128 + 5·256 = 1920, S = 11 costs 2048."""
    import torch
    from omegaconf import OmegaConf

    from lmlab import compose
    from lmlab.config import arch_config
    from lmlab.model.gpt import GPT, validate
    from lmlab.run import budget

    cfg = compose(["data.batch_schedule=[[0,4],[0.5,8]]", "model.max_seq_len=32", "model.n_layer=2",
                   "model.d_model=32", "model.n_head=2", "budget.tokens=2000"])
    gcfg = validate(arch_config(cfg, vocab_size=64))
    spend = budget.apply(cfg, gcfg)
    assert spend["steps"] == cfg.trainer.max_steps == 10
    with torch.device("meta"):
        model = GPT(gcfg)
    tokens = budget.stage_table(OmegaConf.create(OmegaConf.to_container(cfg)), model, 11)
    assert sum(s["tokens_per_step"] for s in tokens) == 128 + 256  # the 11-step plan would pass 2000
