"""budget.flops|tokens|tokens_per_param|wall (lmlab.run.budget): each variant's steps from its own FLOPs per token, the
rule checked by hand; bad budgets refused by key before training; a run records its budget and what it spent."""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from lmlab import compose


def test_a_run_trains_to_its_token_budget(corpus: Path, tmp_path: Path) -> None:
    from lmlab.run.training import train
    from tests.runs import tiny

    args = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith("trainer.max_steps")]
    summary = train(compose([*args, "budget.tokens=3000", "trainer.max_steps=1000"]), tmp_path / "run")
    per_step = 8 * 32
    assert summary["steps"] == 3000 // per_step == 11 and summary["tokens"] == 11 * per_step
    assert summary["budget"]["kind"] == "tokens" and summary["budget"]["steps"] == 11
    assert summary["budget_spent"]["flops"] == summary["tokens"] * summary["flops_per_token"]
    saved = OmegaConf.load(tmp_path / "run" / ".hydra" / "config.yaml")
    assert saved.trainer.max_steps == 11  # the effective config: the schedule was stretched to the budget's steps
