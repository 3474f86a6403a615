"""optim=schedulefree: the evaluation weights x (computed out of place exactly as the package's eval() leaves them),
validation on x, checkpoints holding x with y beside them, and a resume (after a signal at any step, or after a
checkpoint written at validation) that reproduces the uninterrupted run's metrics.csv."""

from __future__ import annotations

import csv
import os
import random
import signal
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lmlab import compose
from lmlab.run.training import train
from tests.runs import tiny

SF = ("optim=schedulefree", "trainer.max_steps=20")


class _Watch(Callback):
    """At each validation: the weights the validation batches see equal x (computed before the module switched),
    and training resumes at y."""

    def __init__(self) -> None:
        self.checked = 0

    def on_validation_start(self, trainer, lit) -> None:  # callbacks first: still train mode here
        opt = trainer.optimizers[0]
        self.x = {n: opt.eval_weights().get(p.data_ptr(), p).clone() for n, p in lit.model.named_parameters()}
        self.y = {n: p.detach().clone() for n, p in lit.model.named_parameters()}
        self.training = opt.training

    def on_validation_batch_start(self, trainer, lit, *args) -> None:
        if trainer.sanity_checking or not self.training:
            return
        assert not trainer.optimizers[0].training
        for n, p in lit.model.named_parameters():
            assert torch.equal(p.detach(), self.x[n]), n
        self.checked += 1

    def on_train_batch_start(self, trainer, lit, *args) -> None:
        if self.checked and hasattr(self, "y"):
            for n, p in lit.model.named_parameters():
                torch.testing.assert_close(p.detach(), self.y[n], rtol=1e-5, atol=1e-6)
            del self.y


def _figures(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in csv.DictReader(f)]


class _Signal(Callback):
    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            os.kill(os.getpid(), signal.SIGTERM)


@pytest.fixture(scope="module")
def straight(corpus: Path, tmp_path_factory) -> tuple[Path, Path, _Watch]:
    base = tmp_path_factory.mktemp("sf")
    watch = _Watch()
    train(compose(tiny(corpus, base / "cache", *SF)), base / "run", callbacks=[watch])
    return base / "run", base / "cache", watch


def test_validation_runs_on_the_eval_weights_and_the_checkpoint_holds_them(straight) -> None:
    run, _, watch = straight
    assert watch.checked >= 2  # the validation batches at steps 10 and 20
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    y = ckpt["lmlab"]["train_weights"]
    assert y and set(y) <= set(ckpt["state_dict"])
    state = ckpt["optimizer_states"][0]
    assert state["param_groups"][0]["train_mode"] is True  # written after training: y in train_weights
    for k, v in y.items():
        assert not torch.equal(v, ckpt["state_dict"][k]), k  # the weights saved are x, not y
    best = torch.load(run / "checkpoints" / "best.ckpt", weights_only=True, map_location="cpu")
    assert "train_weights" not in best["lmlab"]  # written at validation: the parameters held x
    assert best["optimizer_states"][0]["param_groups"][0]["train_mode"] is False
    assert best["global_step"] == ckpt["global_step"] == 20
    for k, v in ckpt["state_dict"].items():  # x at step 20 both, the last from y after its eval→train round trip
        torch.testing.assert_close(best["state_dict"][k], v, rtol=1e-5, atol=1e-7)


def test_a_signal_at_any_step_then_resume_gives_the_same_metrics(straight, corpus: Path, tmp_path: Path) -> None:
    run_straight, cache, _ = straight
    at = int(os.environ.get("LMLAB_TEST_AT", 0)) or random.SystemRandom().randint(1, 18)
    run = tmp_path / "run"
    summary = train(compose(tiny(corpus, cache, *SF)), run, callbacks=[_Signal(at)])
    assert summary["status"] == "interrupted"
    summary = train(compose(tiny(corpus, cache, *SF)), run)
    assert summary["status"] == "completed" and summary["steps"] == 20
    assert _figures(run) == _figures(run_straight), f"signal at step {at}"


def test_resume_from_a_validation_checkpoint_gives_the_same_metrics(straight, corpus: Path, tmp_path: Path) -> None:
    """A run stopped at step 10 and continued to 20 with the same constant schedule from the checkpoint written at
    validation (in eval mode: x as the weights, the optimizer's train_mode false): the same rows as the straight run
    (but `epoch`, which Lightning counts on when it extends a finished fit, whatever the optimizer)."""
    run_straight, cache, _ = straight
    run = tmp_path / "run"
    train(compose(tiny(corpus, cache, *SF[:1], "trainer.max_steps=10")), run)
    best = torch.load(run / "checkpoints" / "best.ckpt", weights_only=True, map_location="cpu")
    assert best["global_step"] == 10 and best["optimizer_states"][0]["param_groups"][0]["train_mode"] is False
    (run / "checkpoints" / "best.ckpt").replace(run / "checkpoints" / "last.ckpt")
    summary = train(compose(tiny(corpus, cache, *SF)), run)
    assert summary["steps"] == 20

    def rows(r: Path) -> list[dict[str, str]]:
        return [{k: v for k, v in row.items() if k != "epoch"} for row in _figures(r)]

    assert rows(run) == rows(run_straight)
