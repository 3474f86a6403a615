"""`tokens` and `tokens_per_s` on 2 CPU ranks (gloo), DDP and FSDP2, against the batches the ranks actually consumed:
each rank counts its own training batches' tokens in a callback and writes them out; the run's tokens are their sum,
summary.json's speed is that over the attempt's wall time, and the live perf/tokens_per_s, on a clock that moves a
second per step, is one global batch a second (perf/mfu over both devices' peak). The one-process checks, the resume
among them: tests/unit/run/test_token_accounting.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import ROOT, metric, tiny
from tests.unit.run.test_fsdp2 import FSDP2

STEPS, PER_RANK, T, PEAK = 3, 4, 32, 1e9  # 3 steps of 2 ranks x 4 sequences of 32 tokens; a made-up peak FLOP/s

# Trains through lmlab.run.training.train with a counting callback that is also perf's clock; Lightning's launcher
# starts rank 1 by running this same file again. Each rank writes what it consumed to consumed_<rank>.json.
DRIVER = """
import json, sys
from pathlib import Path
from lightning.pytorch.callbacks import Callback
import lmlab.run.perf as perf
from lmlab import compose
from lmlab.run.training import train

ARGS, RUN = {args!r}, Path({run!r})

class Consumed(Callback):
    def __init__(self):
        self.numel, self.times_world, self.steps, self.now = 0, 0, 0, 1000.0
    def perf_counter(self):
        return self.now
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.now += 1.0
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.numel += batch[0].numel()
        self.times_world += batch[0].numel() * trainer.world_size
        self.steps += 1
    def on_train_end(self, trainer, pl_module):
        out = RUN.parent / f"consumed_{{RUN.name}}_{{trainer.global_rank}}.json"
        out.write_text(json.dumps({{"numel": self.numel, "times_world": self.times_world, "steps": self.steps,
                                   "world_size": trainer.world_size}}))

consumed = Consumed()
perf.time = consumed  # perf reads time.perf_counter(): one second per training step
summary = train(compose(ARGS), str(RUN), callbacks=[consumed])
sys.exit(0 if summary["status"] == "completed" else 1)
"""


@pytest.mark.parametrize("strategy", [("trainer.strategy=ddp", "trainer.accelerator=cpu", "trainer.devices=2"),
                                      tuple(FSDP2)], ids=["ddp", "fsdp2"])
def test_two_ranks_count_the_tokens_both_consumed(corpus: Path, tmp_path: Path, strategy: tuple[str, ...]) -> None:
    args = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "data.batch"))]
    args += [f"trainer.max_steps={STEPS}", f"trainer.val_check_interval={STEPS}", f"data.batch_size={PER_RANK}",
             f"perf.peak_flops={PEAK}", *strategy]
    run = tmp_path / "run"
    script = tmp_path / "drive.py"
    script.write_text(DRIVER.format(args=args, run=str(run)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]

    ranks = [json.loads((tmp_path / f"consumed_run_{r}.json").read_text()) for r in (0, 1)]
    assert [r["steps"] for r in ranks] == [STEPS, STEPS] and {r["world_size"] for r in ranks} == {2}
    both = sum(r["numel"] for r in ranks)  # what the two ranks consumed between them
    assert both == STEPS * 2 * PER_RANK * T == ranks[0]["times_world"] == ranks[1]["times_world"]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["tokens"] == both
    assert summary["tokens_per_s"] * summary["wall_time_s"] == pytest.approx(both, rel=1e-9)
    assert summary["mfu"] == pytest.approx(summary["tokens_per_s"] * summary["flops_per_token"] / (2 * PEAK),
                                           rel=1e-9)
    step_tokens = 2 * PER_RANK * T  # the global batch
    assert metric(run, "tokens") == {s: (s + 1) * step_tokens for s in range(STEPS)}
    assert metric(run, "perf/tokens_per_s") == {s: step_tokens for s in range(STEPS)}
    mfu = step_tokens * summary["flops_per_token"] / (2 * PEAK)
    assert metric(run, "perf/mfu") == pytest.approx(dict.fromkeys(range(STEPS), mfu), rel=1e-9)
