"""optim=muon: which tensors Muon takes (by rule, on every block kind), one step against torch.optim.Muon and
torch.optim.AdamW, the Newton–Schulz iteration by hand, the learning-rate scale conventions, the momentum warm-up,
and the one-object state_dict a checkpoint and a resume use; an MoE's stacked expert matrices orthogonalised one
expert at a time (a batched Newton–Schulz) against a per-expert loop of torch's Muon."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("name", ["muon", "schedulefree"])
def test_ddp_two_cpu_ranks_follow_one_process(name: str, corpus, tmp_path) -> None:
    """2 CPU ranks (gloo) with 4 sequences each take the steps of one process with the 8 of the same global batch:
    the same train and val losses to float rounding (the all-reduced gradient's summation order; Muon's bf16
    Newton–Schulz amplifies it a little)."""
    from tests.runs import metric, one_and_two_ranks, tiny

    args = [a for a in tiny(corpus, tmp_path / "cache", f"optim={name}", "trainer.max_steps=20")
            if not a.startswith("data.batch")]
    one, two = one_and_two_ranks(args, tmp_path)
    for key in ("train/loss", "val/loss"):
        a, b = metric(one, key), metric(two, key)
        assert a.keys() == b.keys() and len(a) >= 2
        assert list(b.values()) == pytest.approx(list(a.values()), rel=2e-3), key
    # the loss against the unigram baseline is the global batch's too, not rank 0's half of it (issue 59)
    a, b = metric(one, "train/loss_vs_unigram"), metric(two, "train/loss_vs_unigram")
    assert a.keys() == b.keys() and len(a) >= 2
    assert list(b.values()) == pytest.approx(list(a.values()), abs=5e-3)


FAMILY = ["optim.split=heads", "optim.normuon=true", "optim.ns_coefficients=polar_express", "ffn=swiglu"]


@pytest.mark.parametrize("family", [["optim.split=none"], FAMILY], ids=["none", "family"])
def test_fsdp2_two_cpu_ranks_follow_one_process(family: list[str], corpus, tmp_path) -> None:
    """trainer=fsdp2 with optim=muon (each matrix's update gathered, orthogonalised whole on every rank, each rank's
    rows applied): 2 CPU ranks of 4 sequences take one process's steps on the same 8, with the family's keys too
    (per-head pieces of a row-sharded QKV, NorMuon's per-row moments, a fused GLU)."""
    from tests.runs import metric, one_and_two_ranks, tiny

    args = [a for a in tiny(corpus, tmp_path / "cache", "optim=muon", "trainer.max_steps=10", *family)
            if not a.startswith("data.batch")]
    one, two = one_and_two_ranks(args, tmp_path, "fsdp2")
    for key in ("train/loss", "val/loss"):
        a, b = metric(one, key), metric(two, key)
        assert a.keys() == b.keys() and len(a) >= 1, key
        assert list(b.values()) == pytest.approx(list(a.values()), rel=2e-3), key
    losses = metric(one, "train/loss")
    assert losses[9] < losses[0]
