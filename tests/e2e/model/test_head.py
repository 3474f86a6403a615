"""The `head` axis (lmlab.model.head): multi-token prediction against DeepSeek-V3's and Gloeckle et al.'s equations
computed by hand, its evaluation equal to a single-head model's, and `model.untie_at_step`."""

from __future__ import annotations

import pytest
import torch


def test_a_run_unties_at_its_step_and_resumes_across_it(corpus, tmp_path) -> None:
    """The embedding and the head are one matrix before the step, two after; Ctrl-C after the untying and a resume
    reproduce the uninterrupted metrics; MTP's losses are logged apart from train/loss and val/loss."""
    import csv

    from tests.runs import straight_and_resumed

    straight, resumed = straight_and_resumed(corpus, tmp_path, "model.untie_at_step=8", "head=mtp", "head.depth=2")
    rows = []
    for run in (straight, resumed):
        with open(run / "metrics.csv") as f:
            rows.append({int(r["step"]): r for r in csv.DictReader(f)})
    a, b = rows
    assert {"train/mtp_loss_1", "train/mtp_loss_2", "val/mtp_loss_1", "val/mtp_loss_2"} <= set(a[0])
    for step in a:
        for c in ("train/loss", "train/mtp_loss_2", "val/loss", "val/mtp_loss_1", "grad/norm/head"):
            if a[step].get(c) or b[step].get(c):
                assert float(b[step][c]) == pytest.approx(float(a[step][c]), rel=1e-4, abs=1e-6), (step, c)
    state = torch.load(straight / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert bool(state["model.untied"])
    assert not torch.equal(state["model.lm_head.weight"], state["model.wte.weight"])  # trained apart since step 8
