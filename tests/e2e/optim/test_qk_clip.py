"""optim.qk_clip through the training loop: at a threshold the run's logits reach, heads are clipped and logged at
every step, and the largest logit stays near τ where the same run without the clip grows past it; two DDP ranks take
the one process's steps (each head's max logit is the max over both ranks' halves of the batch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab import compose, names
from lmlab.run.training import train
from tests.runs import metric, one_and_two_ranks, tiny

STEPS = ("trainer.max_steps=20", "optim.lr=0.03", "schedule.warmup_steps=0")  # a high lr: the logits grow fast


@pytest.mark.parametrize("attention", ["mha", "mla"])
def test_the_clip_holds_the_max_logit_down(corpus: Path, tmp_path: Path, attention: str) -> None:
    """The same run twice: τ = 10⁹ (measured and logged, never clipped) and τ at half the largest logit that run
    reaches. The clipped run rescales heads, every step logs both figures, and its logits stay below the free run's.
    Not ≤ τ at every step: S is measured in the step's forward and the clip follows the update (Kimi's order), so a
    step can still carry a head past τ by its own growth (at this lr, up to ~1.3τ)."""
    args = tiny(corpus, tmp_path / "cache", *STEPS, "logger=csv", f"attention={attention}")
    free = train(compose([*args, "optim.qk_clip=1e9"]), tmp_path / "free")
    assert free["status"] == "completed"
    grown = metric(tmp_path / "free", names.QK_MAX_LOGIT)
    assert sum(metric(tmp_path / "free", names.QK_CLIPPED_HEADS).values()) == 0
    tau = 0.5 * max(grown.values())
    clipped = train(compose([*args, f"optim.qk_clip={tau}"]), tmp_path / "clipped")
    assert clipped["status"] == "completed"
    heads, peak = (metric(tmp_path / "clipped", n) for n in (names.QK_CLIPPED_HEADS, names.QK_MAX_LOGIT))
    assert sorted(heads) == sorted(peak) == sorted(grown) == list(range(20))  # every step
    assert sum(heads.values()) > 0 and max(heads.values()) <= 2 * 2  # 2 layers of 2 heads
    late = range(10, 20)
    assert max(peak[s] for s in late) < max(grown[s] for s in late)
    assert sum(peak[s] for s in late) < 0.9 * sum(grown[s] for s in late)


@pytest.mark.slow
def test_two_ddp_ranks_take_one_process_steps(corpus: Path, tmp_path: Path) -> None:
    args = [a for a in tiny(corpus, tmp_path / "cache", *STEPS, "optim.qk_clip=1.0", "logger=csv")
            if not a.startswith("data.batch")]
    one, two = one_and_two_ranks(args, tmp_path)
    for key in (names.QK_CLIPPED_HEADS, "train/loss", names.QK_MAX_LOGIT):
        a, b = metric(one, key), metric(two, key)
        assert a.keys() == b.keys() and len(a) >= 10, key
        assert list(b.values()) == pytest.approx(list(a.values()), rel=2e-3, abs=1e-3), key
    assert sum(metric(one, names.QK_CLIPPED_HEADS).values()) > 0
