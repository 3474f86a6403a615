"""The seed split end to end (issue 62): two tiny runs with equal seeds.init and different seeds.data start from
identical weights and see different batches, and the reverse; seeds.dropout gives training's draws their own stream
whatever the init; with no seeds.* key set a run is the one `seed` alone made before the split (its recorded seeds
say so), and a resume with another data seed is warned about by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lmlab import compose
from lmlab.run.training import train
from tests.runs import figures, tiny


class FirstStep(Callback):
    """What step 0 starts from: the weights, the first batch's token ids, the global RNG's state (the dropout stream)
    and the seed the head's masks are keyed by."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 0 and not hasattr(self, "weights"):
            self.weights = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}
            self.ids = batch[0].detach().clone()
            self.rng = torch.get_rng_state()
            self.mask_seed = int(pl_module.hparams.seed)


def _first_step(corpus: Path, tmp_path: Path, name: str, *seeds: str) -> tuple[FirstStep, dict]:
    seen = FirstStep()
    args = tiny(corpus, tmp_path / "cache", "trainer.max_steps=2", "monitor.every_n_steps=0",
                "monitor.attn_every_n_steps=0", "schedule.warmup_steps=1", "model.dropout=0.1", *seeds)
    summary = train(compose(args), tmp_path / name, callbacks=[seen])
    assert summary["status"] == "completed", summary
    return seen, summary


def _same_weights(a: FirstStep, b: FirstStep) -> bool:
    return a.weights.keys() == b.weights.keys() and all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)


def test_the_init_and_the_data_order_vary_apart(corpus: Path, tmp_path: Path) -> None:
    base, base_summary = _first_step(corpus, tmp_path, "base", "seeds.init=1", "seeds.data=1")
    other_data, _ = _first_step(corpus, tmp_path, "data", "seeds.init=1", "seeds.data=2")
    other_init, _ = _first_step(corpus, tmp_path, "init", "seeds.init=2", "seeds.data=1")
    own_dropout, summary = _first_step(corpus, tmp_path, "dropout", "seeds.init=2", "seeds.data=2", "seeds.dropout=3")
    other_both, _ = _first_step(corpus, tmp_path, "both", "seeds.init=1", "seeds.data=1", "seeds.dropout=3")

    # equal seeds.init, different seeds.data: identical weights at step 0, other batches (and head masks' key)
    assert _same_weights(base, other_data)
    assert not torch.equal(base.ids, other_data.ids)
    assert (base.mask_seed, other_data.mask_seed) == (1, 2)
    assert torch.equal(base.rng, other_data.rng)  # the dropout stream follows the init: the same
    # the reverse: equal seeds.data, different seeds.init: the same batches, other weights
    assert torch.equal(base.ids, other_init.ids)
    assert not _same_weights(base, other_init)
    assert not torch.equal(base.rng, other_init.rng)  # no seeds.dropout: the init's stream, another one
    # seeds.dropout: its own stream, whatever the init and the data order
    assert torch.equal(own_dropout.rng, other_both.rng) and not torch.equal(own_dropout.rng, base.rng)
    assert _same_weights(base, other_both) and torch.equal(base.ids, other_both.ids)
    # the effective seeds are recorded in the run's config, in summary.json and .hydra/config.yaml
    assert base_summary["config"]["seeds"] == {"init": 1, "data": 1, "dropout": None}
    assert summary["config"]["seeds"] == {"init": 2, "data": 2, "dropout": 3}
    saved = (tmp_path / "dropout" / ".hydra" / "config.yaml").read_text()
    assert "seeds:\n  init: 2\n  data: 2\n  dropout: 3\n" in saved


def test_no_seeds_key_is_the_run_seed_alone_made(corpus: Path, tmp_path: Path) -> None:
    """`seed=7` alone and with the seeds it implies written out (init and data 7, dropout following the init) are one
    run, figure for figure; the recorded seeds say what it used."""
    plain, plain_summary = _first_step(corpus, tmp_path, "plain", "seed=7")
    spelled, _ = _first_step(corpus, tmp_path, "spelled", "seed=7", "seeds.init=7", "seeds.data=7")
    other, _ = _first_step(corpus, tmp_path, "other", "seed=8")
    assert _same_weights(plain, spelled) and torch.equal(plain.ids, spelled.ids) and torch.equal(plain.rng, spelled.rng)
    assert figures(tmp_path / "plain") == figures(tmp_path / "spelled")
    assert figures(tmp_path / "plain") != figures(tmp_path / "other")  # the comparison sees a change of seed
    assert plain_summary["config"]["seed"] == 7
    assert plain_summary["config"]["seeds"] == {"init": 7, "data": 7, "dropout": None}


def test_a_resume_with_another_data_seed_is_warned_about_by_name(corpus: Path, tmp_path: Path) -> None:
    """As for `seed` before the split: the order no longer continues the checkpoint's; the warning names the seed."""
    args = tiny(corpus, tmp_path / "cache", "trainer.max_steps=2", "monitor.every_n_steps=0",
                "monitor.attn_every_n_steps=0", "schedule.warmup_steps=1", "seeds.data=1")
    train(compose(args), tmp_path / "run")
    with pytest.warns(UserWarning, match=r"resuming with a different data seed \(seeds\.data, else seed\) than the "
                                         r"checkpoint: the data order will not match"):
        summary = train(compose([*args, "trainer.max_steps=4", "seeds.data=2", "resume=true"]), tmp_path / "run")
    assert summary["steps"] == 4
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["config"]["seeds"]["data"] == 2


def test_the_golden_run_with_its_seeds_spelled_out_logs_the_pinned_losses(tmp_path: Path) -> None:
    """tests/golden's tiny run (pinned before the split) with seeds.init and seeds.data written out as `seed`'s value:
    the pinned losses (tests/e2e/project/test_golden.py runs it with no seeds.* key)."""
    from tests.e2e.project.test_golden import same_losses
    from tests.golden import regenerate as golden
    from tests.runs import metric

    expected = json.loads(golden.LOSSES.read_text())
    overrides = [*golden.RUN, "seeds.init=1337", "seeds.data=1337"]
    train(compose(overrides), tmp_path / "run", overrides=overrides)  # as the golden run: its warmup the one it sets
    actual = {name: {str(step): round(v, golden.DIGITS) for step, v in metric(tmp_path / "run", name).items()}
              for name in ("train/loss", "val/loss")}
    assert same_losses(expected, actual) == []
