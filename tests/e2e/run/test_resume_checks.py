"""A resume that would change the run refuses or says so: the global batch (data.batch_size x ranks x
trainer.accumulate_grad_batches) the checkpoint recorded, and the data (data=token_bin's shards, a text corpus's
fingerprint). Another launch at the same global batch goes on and is recorded in summary.json; a checkpoint that
recorded no launch (an older lmlab's) is not checked."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lmlab import compose
from lmlab.data.token_bin import write_shard
from tests.runs import CtrlC, metric, tiny


def _tree(run: Path) -> list:
    return sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))


def test_a_resume_at_another_batch_or_accumulation_is_refused_before_anything_is_written(corpus, tmp_path) -> None:
    """Interrupted at step 12 at batch 8; resumed at batch 4 (half the global batch), or at batch 8 with
    trainer.accumulate_grad_batches=2 (twice it): refused, nothing written; as it was, the resume goes on."""
    from lmlab.run.training import train

    run, args = tmp_path / "run", tiny(corpus, tmp_path / "cache", "trainer.max_steps=20")
    with pytest.raises(SystemExit):
        train(compose(args), run, callbacks=[CtrlC(at=12)])
    before = _tree(run)
    with pytest.raises(ValueError, match=rf"global batch is 8 sequences per step .* this launch's 4 .*data\.batch_size: "
                                         rf"checkpoint 8, now 4\).*as it was: python train.py hydra.run.dir={run} "
                                         rf"data\.batch_size=8; or .* data\.batch_size=8$"):
        train(compose([*args, "data.batch_size=4"]), run)
    with pytest.raises(ValueError, match=r"this launch's 16 .*trainer\.accumulate_grad_batches: checkpoint 1, now 2"):
        train(compose([*args, "trainer.accumulate_grad_batches=2"]), run)
    assert _tree(run) == before
    summary = train(compose(args), run)
    assert summary["status"] == "completed" and summary["steps"] == 20 and summary["relaunched"] is None
    assert "changed" not in summary["attempts"][-1]


def test_a_resume_at_the_same_global_batch_by_accumulation_continues_the_run(corpus, tmp_path) -> None:
    """Interrupted at step 12 at batch 8, resumed at batch 4 x trainer.accumulate_grad_batches=2 (the same 8
    sequences a step): the losses follow the straight run's (the same data; summed in two halves, so not
    bit-equal),
    validation comes at the same steps (Lightning counts it in micro-batches: the checkpoint's counts are rescaled),
    and summary.json records what changed."""
    from lmlab.run.training import train

    args = tiny(corpus, tmp_path / "cache", "trainer.max_steps=20", "trainer.val_check_interval=4")
    straight, run = tmp_path / "straight", tmp_path / "run"
    train(compose(args), straight)
    with pytest.raises(SystemExit):
        train(compose(args), run, callbacks=[CtrlC(at=12)])
    summary = train(compose([*args, "data.batch_size=4", "trainer.accumulate_grad_batches=2"]), run)
    assert summary["status"] == "completed" and summary["steps"] == 20
    assert summary["attempts"][-1]["changed"] == {"batch_size": [8, 4], "accumulate_grad_batches": [1, 2]}
    want, got = metric(straight, "train/loss"), metric(run, "train/loss")
    assert sorted(got) == sorted(want) == list(range(20))  # one row a step, none trained twice or skipped
    assert {s: got[s] for s in range(12)} == {s: want[s] for s in range(12)}
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)  # train/loss: the whole window's mean, as the batch's
    want, got = metric(straight, "val/loss"), metric(run, "val/loss")
    assert sorted(got) == sorted(want) == [3, 7, 11, 15, 19], (sorted(got), sorted(want))
    assert got == pytest.approx(want, rel=1e-4, abs=1e-5)


def _bin_args(d: Path) -> list[str]:
    return ["data=token_bin", f"data.train={d}/train_*.bin", f"data.val={d}/val_*.bin", "data.val_tokens=330",
            "data.vocab_size=64", "data.batch_size=4", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
            "model.max_seq_len=32", "trainer.max_steps=12", "trainer.val_check_interval=6", "logger=none",
            "threads=1", "trainer.enable_progress_bar=false", "monitor.attn_every_n_steps=0"]


def test_a_token_bin_resume_refuses_shards_added_or_changed(tmp_path, monkeypatch) -> None:
    """A shard added between the interruption and the resume, or one rewritten in place (same size): refused naming
    data.train with both fingerprints, nothing written; the shards put back, the resume goes on."""
    from lmlab.run.training import train

    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))  # the shards' remembered digests
    d, rng = tmp_path / "shards", np.random.default_rng(0)
    for i in range(2):
        write_shard(d / f"train_{i}.bin", rng.integers(0, 64, 4000))
    write_shard(d / "val_0.bin", rng.integers(0, 64, 400))
    run, args = tmp_path / "run", _bin_args(d)
    with pytest.raises(SystemExit):
        train(compose(args), run, callbacks=[CtrlC(at=5)])
    before = _tree(run)
    original = (d / "train_1.bin").read_bytes()
    write_shard(d / "train_2.bin", rng.integers(0, 64, 4000))  # added
    with pytest.raises(ValueError, match=r"data\.train is not the data the checkpoint was trained on \(checkpoint: "
                                         r"2 shards, 8,000 tokens, sha256 \w{12}; now: 3 shards, 12,000 tokens"):
        train(compose(args), run)
    (d / "train_2.bin").unlink()
    write_shard(d / "train_1.bin", rng.integers(0, 64, 4000))  # changed in place: same size, other ids
    with pytest.raises(ValueError, match=rf"data\.train is not the data .*now: 2 shards, 8,000 tokens, sha256 \w{{12}}"
                                         rf"\).*continue with python train.py hydra.run.dir={run}, or start a new run"):
        train(compose(args), run)
    assert _tree(run) == before
    (d / "train_1.bin").write_bytes(original)
    assert train(compose(args), run)["status"] == "completed"
