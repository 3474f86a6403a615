"""The run-time features (lmlab.run.features): each declared in its own file and gathered, its keys checked by
check_config, its callbacks placed where the run has always put them."""

from __future__ import annotations

import pytest

from lmlab import compose
from lmlab.run import features
from lmlab.run.checks import check_config


def test_each_feature_is_gathered_from_its_own_file_in_callback_order() -> None:
    names = [f.name for f in features.features()]
    assert set(names) == {"downstream", "fp8", "jacobian", "keep_last", "qk_clip", "spike_skip"}
    # keep_last's step checkpoints beside ModelCheckpoint; the Jacobian norms measured before QK-clip rescales, the
    # downstream tasks last
    assert names[0] == "keep_last"
    assert names.index("jacobian") < names.index("qk_clip") < names.index("downstream")


@pytest.mark.parametrize("override, refusal", [
    ("checkpoint.keep_last=0", r"^checkpoint\.keep_last=0 must be an integer >= 1 or null"),
    ("spike_skip.window=1", r"^spike_skip\.window=1 must be"),
    ("downstream.tasks=[no_such_task]", r"^downstream\.tasks: unknown task 'no_such_task'"),
    ("precision.fp8=[nothing]", r"precision\.fp8"),
])
def test_a_features_bad_key_is_refused_by_check_config_naming_it(override: str, refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        check_config(compose([override]))


def test_the_option_that_needs_a_feature_is_checked_by_it() -> None:
    """optim.qk_clip needs its clip in the loop: the QK-clip feature refuses what it cannot clip (a sharded W_q)."""
    with pytest.raises(ValueError, match=r"^optim\.qk_clip=100\.0 with trainer=fsdp2"):
        check_config(compose(["optim.qk_clip=100.0", "trainer=fsdp2", "trainer.accelerator=cpu"]))


def test_check_config_returns_the_meta_model_it_built() -> None:
    model = check_config(compose([]))
    assert next(model.parameters()).device.type == "meta"


def test_the_features_a_config_turns_on_start_with_their_callbacks(tmp_path) -> None:
    import torch

    from lmlab.record.rundir import RunDir
    from lmlab.run.jacobian import JacobianNorms
    from lmlab.run.keep_last import KeepLast
    from lmlab.run.qk_clip import QKClipCallback

    cfg = compose(["jacobian.every_n_steps=3", "optim.qk_clip=50", "checkpoint.keep_last=2"])
    started = features.start(cfg, features.Start(RunDir(tmp_path), torch.nn.Linear(2, 2), None, None, 0))
    assert list(started) == ["keep_last", "jacobian", "qk_clip"]
    kinds = [type(c) for s in started.values() for c in s.callbacks]
    assert kinds == [KeepLast, JacobianNorms, QKClipCallback]
    assert all(s.figures() == {} for s in started.values())
    assert features.start(compose([]), features.Start(RunDir(tmp_path), None, None, None, 0)) == {}
