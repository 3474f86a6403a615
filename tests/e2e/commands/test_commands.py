"""The installed command (`lmlab train|eval|generate|compare|bench`, `python -m lmlab`) and the names of sweep jobs:
a sweep command run again with more steps continues its jobs in place; a misspelt option or key is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import ROOT, cli, metric, tiny


def test_a_sweep_command_with_more_steps_continues_its_jobs_in_place(corpus: Path, tmp_path: Path) -> None:
    """The same sweep command, `trainer.max_steps` raised: each job continues in its own directory (which the steps
    do not name) from its checkpoint, to the new total; `lmlab compare` reads the sweep."""
    sweep = tmp_path / "sweep"
    args = [*tiny(corpus, tmp_path / "cache", "model.n_layer=1", "trainer.max_steps=10"), "placement=pre,post",
            f"hydra.sweep.dir={sweep}"]
    first = cli("-m", "lmlab", "train", "-m", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert len(jobs) == 2 and not any("max_steps" in j for j in jobs), jobs
    again = cli(str(ROOT / "train.py"), "-m", *args, "trainer.max_steps=20", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in sweep.iterdir() if p.is_dir()) == jobs  # no new job directories
    for job in jobs:
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["steps"] == 20
        assert [(a["from_step"], a["to_step"]) for a in summary["attempts"]] == [(0, 10), (10, 20)]
        assert sorted(metric(sweep / job, "train/loss")) == list(range(20))
    res = cli("-m", "lmlab", "compare", str(sweep), cwd=tmp_path)
    assert res.returncode == 0 and "placement" in res.stdout and (sweep / "compare.md").exists(), res.stderr[-2000:]


def test_python_m_lmlab_is_the_script(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "lmlab", "eval"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip() == ("lmlab eval: one of run=<run dir>, hf=<transformers dir> or compare=<multirun dir> "
                                  "is needed")


def test_lmlab_train_starts_ddp_ranks_as_itself(corpus: Path, tmp_path: Path) -> None:
    """Lightning's DDP launcher starts the other ranks by re-running the main module with sys.argv[1:]: under `python
    -m lmlab train` that is `python -m lmlab.commands.train <overrides>`, which must train the same run."""
    run = tmp_path / "run"
    args = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "data.batch"))]
    res = cli("-m", "lmlab", "train", *args, "trainer.max_steps=3", "trainer.val_check_interval=3",
              "data.batch_size=4", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp",
              f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3 and summary["world_size"] == 2


@pytest.mark.parametrize("script, args", [("train.py", ["optim.lrr=1e-3"]), ("train.py", ["norm=rsm"]),
                                          ("train.py", ["model.n_layer=["]),
                                          ("eval.py", ["run=x", "lenghts=[256]"]),
                                          ("generate.py", ["run=x", "promt=hi"])])
def test_a_misspelt_option_or_key_is_one_line_and_exit_2(tmp_path: Path, script: str, args: list[str]) -> None:
    """Instead of Hydra's several lines, exit 1 and, for a key, the hint `+optim.lrr`, which would add it."""
    res = cli(str(ROOT / script), *args, cwd=tmp_path)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert res.stderr.startswith(f"{script}: {args[-1]}: ")
    assert "did you mean" in res.stderr or "grammar" in res.stderr
    assert "+optim" not in res.stderr and not (tmp_path / "outputs").exists()
