"""lmlab.model.loss.cross_entropy is torch's mean token cross-entropy, in value and gradient: the closed-form backward
(softmax − onehot, scaled) is checked numerically, against F.cross_entropy with ignored targets, on bf16 logits,
and through LitGPT's loss on a real model. linear_cross_entropy (the head and the loss in row blocks, for
`model.chunked_loss`) is the same loss and the same gradients, and keeps no (tokens, vocab) tensor for backward."""

from __future__ import annotations

import math


def test_a_run_with_a_z_loss_logs_it_apart_from_the_loss(corpus, tmp_path) -> None:
    import csv

    from lmlab import compose
    from lmlab.run.training import train
    from tests.runs import tiny

    run = tmp_path / "run"
    summary = train(compose(tiny(corpus, tmp_path / "cache", "optim.z_loss=1e-3", "model.logit_softcap=30",
                                 "trainer.max_steps=10", "trainer.val_check_interval=10")), run)
    assert summary["status"] == "completed"
    rows = [r for r in csv.DictReader(open(run / "metrics.csv")) if r.get("train/z_loss")]
    assert len(rows) == 10 and all(float(r["train/z_loss"]) > 0 for r in rows)
    # the loss logged is the cross-entropy alone: at step 0 about ln V, which the z-loss (log Z)² would exceed
    assert abs(float(rows[0]["train/loss"]) - math.log(summary["model"]["vocab_size"])) < 0.5
