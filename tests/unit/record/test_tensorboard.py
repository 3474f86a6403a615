"""logger=tensorboard (lmlab/record/tensorboard.py): the losses sort first among TensorBoard's chart groups, and the
HParams
table, ordered by TensorBoard's own rule (the keys that differ first, then by name), starts with the keys the run's
overrides set."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab import compose
from lmlab.run.training import train
from tests.runs import metric, tiny

pytest.importorskip("tensorboard", reason="the dashboard extra: pip install '.[dashboard]'")


def _events(run: Path) -> tuple[dict[str, dict[int, float]], bytes]:
    """The run's scalars by tag and step, and its HParams experiment summary's plugin content."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.util import tensor_util

    scalars, experiment = {}, b""
    for path in sorted((run / "tensorboard").rglob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.tag == "_hparams_/experiment":
                    experiment = value.metadata.plugin_data.content
                elif value.HasField("tensor") and value.metadata.plugin_data.plugin_name == "scalars":
                    scalars.setdefault(value.tag, {})[event.step] = float(tensor_util.make_ndarray(value.tensor))
                elif value.HasField("simple_value"):
                    scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars, experiment


def test_tensorboard_opens_on_the_losses_and_the_hparams_table_on_the_set_keys(corpus: Path, tmp_path: Path) -> None:
    from tensorboard.plugins.hparams import backend_context, metadata

    run = tmp_path / "run"
    own = ["norm=rms", "trainer.max_steps=20", "optim.lr=2e-3", "logger=tensorboard"]
    args = [*(a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "logger"))), *own]
    train(compose(args), run, overrides=own)
    scalars, content = _events(run)
    groups = sorted({tag.split("/")[0] for tag in scalars})
    assert groups[0] == "0_loss" and {"act", "attn", "grad", "train", "val"} <= set(groups), groups
    train_loss = metric(run, "train/loss")
    assert scalars["0_loss/train"] == pytest.approx(scalars["train/loss"]) and len(train_loss) == 20
    assert sorted(scalars["0_loss/val"]) == sorted(scalars["val/loss"]) and len(scalars["0_loss/val"]) == 2
    experiment = metadata.parse_experiment_plugin_data(content)
    backend_context._sort_and_reduce_to_hparams_limit(experiment)  # TensorBoard's own order for the table
    shown = [h.name for h in experiment.hparam_infos]
    assert shown[:3] == ["norm/name", "optim/lr", "trainer/max_steps"], shown[:8]  # (logger= sets a dict of them)
    assert len(shown) > 50  # the whole config after them
