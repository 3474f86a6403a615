"""data.batch_schedule and data.seq_schedule (lmlab.data.stages) across a resume: a run interrupted where its batch
and its length change and resumed trains step for step on the samples, shapes, lr and losses of the run trained
straight through; summary.json keeps the stages, and the tokens, FLOPs and lr follow them."""

from __future__ import annotations

import json

import pytest
from lightning.pytorch.callbacks import Callback


class Shapes(Callback):
    """Each step's batch as the model reads it (after the length's cut) and the lr it steps with."""

    def __init__(self, seen: dict[int, tuple]) -> None:
        self.seen = seen

    def on_train_batch_start(self, trainer, lit, batch, batch_idx) -> None:
        from lmlab.data import stages

        length = stages.at(lit.hparams.stages["seq"], trainer.global_step, lit.hparams.max_steps, batch[0].size(1))
        lr = trainer.optimizers[0].param_groups[0]["lr"]
        self.seen[trainer.global_step] = (tuple(batch[0].reshape(-1, length).shape), int(batch[0][0, 0]), lr)


def test_a_resume_at_a_stage_change_trains_the_uninterrupted_runs_steps(corpus, tmp_path) -> None:
    from lmlab import compose
    from tests.runs import metric_rows, straight_and_resumed, tiny

    extra = ("data.batch_schedule=[[0,4],[0.5,8]]", "data.seq_schedule=[[0,16],[0.5,32]]", "data.batch_lr_power=0.5",
             "schedule=constant", "schedule.warmup_steps=0", "trainer.max_steps=6", "trainer.val_check_interval=3")
    a, b = {}, {}
    straight, resumed = straight_and_resumed(corpus, tmp_path, *extra, at=3, watch=(Shapes(a), Shapes(b)))
    lr = compose(tiny(corpus, tmp_path / "cache", *extra)).optim.lr
    # steps 0-2: 4 blocks of 32 read as 8 sequences of 16; steps 3-5: 8 blocks whole, the lr × (8/4)^0.5
    assert [a[s][0] for s in range(6)] == [(8, 16)] * 3 + [(8, 32)] * 3
    assert [a[s][2] for s in range(6)] == pytest.approx([lr] * 3 + [lr * 2 ** 0.5] * 3)
    assert a == b  # the same first token of every step's batch: the same samples
    rows_a, rows_b = metric_rows(straight), metric_rows(resumed)
    for step, row in rows_a.items():
        for c in ("train/loss", "val/loss"):
            if c in row:
                assert float(rows_b[step][c]) == pytest.approx(float(row[c]), rel=1e-5), (step, c)
    summary = json.loads((resumed / "summary.json").read_text())
    assert summary["tokens"] == (3 * 4 + 3 * 8) * 32
    assert [(s["from_step"], s["batch_size"], s["seq_len"], s["tokens_per_step"]) for s in summary["stages"]] == \
        [(0, 4, 16, 128), (3, 8, 32, 256)]
    short, full = (s["flops_per_token"] for s in summary["stages"])
    assert short < full  # attention over 16 keys, not 32
    assert summary["budget_spent"]["flops"] == pytest.approx(3 * 128 * short + 3 * 256 * full)
