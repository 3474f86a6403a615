"""A run that diverges ends with status `diverged` (lmlab.run.training decides it from the divergence rule,
lit.divergence.status), in the summary train() returns and in summary.json on disk, its attempt too; it stops at
once, and its checkpoint is kept. In the unit tier: the e2e sweep was the
only test that saw it."""

from __future__ import annotations

import json
import math
from pathlib import Path

from lmlab import compose
from lmlab.run.training import train
from tests.runs import metric, tiny


def test_a_diverged_run_is_recorded_as_diverged(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    cfg = compose(tiny(corpus, tmp_path / "cache", "optim.lr=1e3", "optim.grad_clip=0", "schedule.warmup_steps=0",
                       "divergence.min_steps=2", "trainer.max_steps=30", "trainer.val_check_interval=10"))
    summary = train(cfg, run)
    on_disk = json.loads((run / "summary.json").read_text())
    for s in (summary, on_disk):
        assert s["status"] == "diverged", s["status"]
        assert s["attempts"][-1]["status"] == "diverged"
        assert isinstance(s["diverged_at_step"], int) and s["divergence_reason"]
    step = on_disk["diverged_at_step"]
    assert step < 30 and on_disk["steps"] <= step + 1 < 30  # stopped at once, far short of max_steps
    losses = metric(run, "train/loss")
    assert max(losses) <= step  # nothing trained after it
    bad = losses[step]
    assert not math.isfinite(bad) or bad > 3.0 * min(v for s, v in losses.items() if s < step)  # the rule's reasons
    assert (run / "checkpoints" / "last.ckpt").is_file()
