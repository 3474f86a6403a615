"""`lmlab branch` as a user runs it: a decay branch from a WSD trunk's stable-phase step checkpoint is a run of its
own whose first step is the trunk's (the same loss, the same learning rate), that then cools down linearly to the
trunk's min_lr_ratio at its last step, records its trunk, leaves the trunk's directory untouched, and sits beside the
trunk in `eval.py compare=` as another budget point; what cannot branch is refused in one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lmlab.analysis.compare import compare
from tests.runs import ROOT, cli, metric_rows, tiny


@pytest.fixture(scope="module")
def trunk(corpus: Path, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("branch")
    run = d / "sweep" / "trunk"
    res = cli("train.py", *tiny(corpus, d / "cache", "schedule=wsd", "trainer.max_steps=30",
                                "trainer.val_check_interval=5", "checkpoint.keep_last=3", "logger=csv"),
              f"hydra.run.dir={run}", cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    return run


def test_a_branch_starts_as_the_trunk_and_cools_down(trunk: Path) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in (trunk / "checkpoints").iterdir()}
    res = cli("-m", "lmlab", "branch", str(trunk), "at=20", "decay=5", cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    branch = trunk.parent / "trunk_branch_20+5"
    ours, theirs = metric_rows(branch), metric_rows(trunk)
    assert ours[20]["train/loss"] == theirs[20]["train/loss"]  # the same weights, optimizer state, batch and lr
    assert ours[21]["train/loss"] == theirs[21]["train/loss"]  # step 20's update at the trunk's peak lr
    assert all(ours[s] == theirs[s] for s in range(20))  # the trunk's rows before the branch, kept
    peak = float(theirs[20]["lr"])
    assert [float(ours[s]["lr"]) / peak for s in range(20, 25)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    assert float(theirs[24]["lr"]) == pytest.approx(peak)  # the trunk itself was still at its peak there
    summary = json.loads((branch / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 25
    assert summary["config"]["trunk"] == {"run": str(trunk.resolve()), "step": 20}
    assert {p.name: p.stat().st_mtime_ns for p in (trunk / "checkpoints").iterdir()} == before
    rows, _ = compare(trunk.parent)
    assert len(rows) == 2  # the trunk and its branch: two budget points of one trunk


@pytest.mark.parametrize("args, message", [
    (["at=15", "decay=5"], r"at=15: .* keeps step checkpoints at \[20, 25, 30\]"),
    (["at=25", "decay=5"], r"at=25 is not in the trunk's stable phase, steps 5\.\.23"),
    (["at=20", "decay=0"], r"decay=0 must be a step count >= 1"),
])
def test_what_cannot_branch_is_refused_by_key(trunk: Path, args: list[str], message: str) -> None:
    import re

    res = cli("-m", "lmlab", "branch", str(trunk), *args, cwd=ROOT)
    assert res.returncode == 2 and re.search(message, res.stderr), res.stderr[-2000:]
    at, decay = (a.partition("=")[2] for a in args)
    assert not (trunk.parent / f"trunk_branch_{at}+{decay}").exists()  # nothing left behind


def test_a_branch_that_train_refuses_leaves_nothing_behind(trunk: Path) -> None:
    res = cli("-m", "lmlab", "branch", str(trunk), "at=25", "decay=3", "out=" + str(trunk.parent / "typo"),
              "optim.lrr=1", cwd=ROOT)
    assert res.returncode != 0
    assert "stable phase" in res.stderr and not (trunk.parent / "typo").exists()
    res = cli("-m", "lmlab", "branch", str(trunk), "at=20", "decay=3", "out=" + str(trunk.parent / "typo"),
              "optim.lrr=1", cwd=ROOT)
    assert res.returncode != 0 and "optim.lrr" in res.stderr, res.stderr[-2000:]
    assert not (trunk.parent / "typo").exists()  # train refused the key: the laid-out branch is removed
