"""A resume that would change the run refuses or says so: the global batch (data.batch_size x ranks x
trainer.accumulate_grad_batches) the checkpoint recorded, and the data (data=token_bin's shards, a text corpus's
fingerprint). Another launch at the same global batch goes on and is recorded in summary.json; a checkpoint that
recorded no launch (an older lmlab's) is not checked."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lmlab import compose
from lmlab.run.checks import strategy_name
from lmlab.data.token_bin import write_shard
from lmlab.run.plan import check_same_launch, planned_launch
from tests.runs import CtrlC, tiny

FSDP2 = ["trainer=fsdp2", "trainer.accelerator=cpu", "trainer.precision=32-true"]


def _planned(*args: str) -> dict:
    cfg = compose(list(args))
    return planned_launch(cfg, strategy_name(cfg))


def test_the_planned_launch_counts_ranks_as_lightning_does() -> None:
    assert _planned("trainer=cpu", "data.batch_size=8") == {
        "world_size": 1, "num_nodes": 1, "devices": 1, "strategy": "SingleDeviceStrategy",
        "accumulate_grad_batches": 1, "batch_size": 8}
    assert _planned(*FSDP2, "trainer.devices=2")["world_size"] == 2
    assert _planned(*FSDP2, "trainer.devices=2")["strategy"] == "FSDP2Strategy"
    assert _planned("trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.num_nodes=3")[
        "world_size"] == 6
    assert _planned("trainer.accelerator=cpu", "trainer.devices=auto")["world_size"] == 1  # Lightning: one CPU process


def test_another_global_batch_is_refused_naming_the_keys_and_both_commands() -> None:
    saved = _planned(*FSDP2, "trainer.devices=2", "data.batch_size=4")  # what a checkpoint of that launch records
    with pytest.raises(ValueError) as err:
        check_same_launch("resume=auto (r/last.ckpt)", saved, _planned(*FSDP2, "trainer.devices=1",
                                                                        "data.batch_size=4"), Path("r"))
    message = str(err.value)
    assert "\n" not in message and "global batch is 8 sequences per step" in message and "this launch's 4" in message
    assert "trainer.devices: checkpoint 2, now 1" in message
    assert message.endswith("continue it as it was: python train.py hydra.run.dir=r trainer.devices=2; or at the "
                            "same global batch on 1 rank(s): python train.py hydra.run.dir=r trainer.devices=1 "
                            "data.batch_size=8")
    # the same global batch another way goes on, and says what changed
    assert check_same_launch("resume", saved, _planned(*FSDP2, "trainer.devices=1", "data.batch_size=8"),
                             Path("r")) == {"world_size": [2, 1], "devices": [2, 1], "batch_size": [4, 8]}
    with pytest.raises(ValueError, match=r"trainer\.accumulate_grad_batches: checkpoint 1, now 2.*keeps the global "
                                         r"batch and its accumulation"):  # Lightning's loops count micro-batches
        check_same_launch("resume", saved, _planned(*FSDP2, "trainer.devices=1", "data.batch_size=4",
                                                    "trainer.accumulate_grad_batches=2"), Path("r"))
    assert check_same_launch("resume", saved, saved, Path("r")) is None
    assert check_same_launch("resume", None, _planned("data.batch_size=1"), Path("r")) is None  # no record: older


def _tree(run: Path) -> list:
    return sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))


@pytest.mark.e2e
def test_a_resume_at_another_batch_or_accumulation_is_refused_before_anything_is_written(corpus, tmp_path) -> None:
    """Interrupted at step 12 at batch 8; resumed at batch 4 (half the global batch), or at batch 4 with
    trainer.accumulate_grad_batches=2 (Lightning would start with half a window): refused, nothing written; as it
    was, the resume goes on."""
    from lmlab.run.training import train

    run, args = tmp_path / "run", tiny(corpus, tmp_path / "cache", "trainer.max_steps=20")
    with pytest.raises(SystemExit):
        train(compose(args), run, callbacks=[CtrlC(at=12)])
    before = _tree(run)
    with pytest.raises(ValueError, match=rf"global batch is 8 sequences per step .* this launch's 4 .*data\.batch_size: "
                                         rf"checkpoint 8, now 4\).*as it was: python train.py hydra.run.dir={run} "
                                         rf"data\.batch_size=8; or .* data\.batch_size=8$"):
        train(compose([*args, "data.batch_size=4"]), run)
    with pytest.raises(ValueError, match=r"this launch's 8 .*trainer\.accumulate_grad_batches: checkpoint 1, now 2"):
        train(compose([*args, "data.batch_size=4", "trainer.accumulate_grad_batches=2"]), run)
    assert _tree(run) == before
    summary = train(compose(args), run)
    assert summary["status"] == "completed" and summary["steps"] == 20 and summary["relaunched"] is None
    assert "changed" not in summary["attempts"][-1]


def _bin_args(d: Path) -> list[str]:
    return ["data=token_bin", f"data.train={d}/train_*.bin", f"data.val={d}/val_*.bin", "data.val_tokens=330",
            "data.vocab_size=64", "data.batch_size=4", "model.n_layer=1", "model.d_model=32", "model.n_head=2",
            "model.max_seq_len=32", "trainer.max_steps=12", "trainer.val_check_interval=6", "logger=none",
            "threads=1", "trainer.enable_progress_bar=false", "monitor.attn_every_n_steps=0"]


@pytest.mark.e2e
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


def test_a_text_corpus_other_than_the_checkpoints_is_refused(corpus, tmp_path) -> None:
    """A text corpus's fingerprint was recorded and only warned about (the data order will not match): refused now,
    naming the corpus; the same corpus passes."""
    from lmlab.data import build_datamodule
    from lmlab.run.plan import check_same_data

    data = build_datamodule({**compose(tiny(corpus, tmp_path / "cache")).data}, seq_len=32, seed=0)
    data.setup("fit")
    saved = {"TextDataModule": data.state_dict()}
    check_same_data("resume", data, saved, tmp_path / "run")
    saved["TextDataModule"]["corpus_sha256"] = "0" * 64
    with pytest.raises(ValueError, match=r"resume: data=text_files is not the data the checkpoint was trained on "
                                         r"\(checkpoint: sha256 000000000000; now: sha256 \w{12}\)"):
        check_same_data("resume", data, saved, tmp_path / "run")
