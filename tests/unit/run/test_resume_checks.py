"""A resume that would change the run refuses or says so: the global batch (data.batch_size x ranks x
trainer.accumulate_grad_batches) the checkpoint recorded, and the data (data=token_bin's shards, a text corpus's
fingerprint). Another launch at the same global batch goes on and is recorded in summary.json; a checkpoint that
recorded no launch (an older lmlab's) is not checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab import compose
from lmlab.run.checks import strategy_name
from lmlab.run.plan import check_same_launch, planned_launch
from tests.runs import tiny

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
    # the same global batch by accumulation goes on too (Lightning's micro-batch counts rescaled on load: lit.py)
    assert check_same_launch("resume", saved, _planned(*FSDP2, "trainer.devices=1", "data.batch_size=4",
                                                       "trainer.accumulate_grad_batches=2"), Path("r")) == {
        "world_size": [2, 1], "devices": [2, 1], "accumulate_grad_batches": [1, 2]}
    with pytest.raises(ValueError) as err:  # another global batch by accumulation: refused, the same one suggested
        check_same_launch("resume", saved, _planned(*FSDP2, "trainer.devices=1", "data.batch_size=4",
                                                    "trainer.accumulate_grad_batches=4"), Path("r"))
    assert "trainer.accumulate_grad_batches: checkpoint 1, now 4" in str(err.value)
    assert str(err.value).endswith("same global batch on 1 rank(s): python train.py hydra.run.dir=r trainer.devices=1 "
                                   "trainer.accumulate_grad_batches=4 data.batch_size=2")
    assert check_same_launch("resume", saved, saved, Path("r")) is None
    assert check_same_launch("resume", None, _planned("data.batch_size=1"), Path("r")) is None  # no record: older


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
