"""Start-up builds the model on the meta device once: the command's checks, the plan, the budget and the memory
estimates all read that one model (lmlab.run.checks.check_config returns it)."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.runs import tiny


def test_one_start_builds_the_model_on_the_meta_device_once(corpus: Path, tmp_path: Path, monkeypatch) -> None:
    """`python train.py ...` in this process, trained for one step: exactly one meta build (three before: the
    command's checks, train()'s own checks again, the plan's validation)."""
    from lmlab.commands import train as command
    from lmlab.model.gpt import GPT

    builds = []
    init = GPT.__init__

    def counted(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        if next(self.parameters()).device.type == "meta":
            builds.append(self.cfg.vocab_size)

    monkeypatch.setattr(GPT, "__init__", counted)
    monkeypatch.setattr(command, "catch_early", lambda: None)  # the test process keeps its own signal handlers
    monkeypatch.setattr(command, "quick_exit", lambda: None)
    monkeypatch.setattr(sys, "argv", ["train.py"])
    monkeypatch.setenv("PYTHONSAFEPATH", "1")
    run = tmp_path / "run"
    command.run("python train.py", tiny(corpus, tmp_path / "cache", "trainer.max_steps=1", f"hydra.run.dir={run}"))
    assert (run / "summary.json").is_file()
    assert len(builds) == 1, builds

