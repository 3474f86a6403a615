"""tests/warm.py, the warm interpreter most tests run lmlab's commands in: a command run there writes what it writes
in a new interpreter (the run's figures, its summary, its output, its exit code), and a command it cannot run as a
new interpreter would (another checkout's script, another environment) is left to one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.runs import ROOT, _warm, tiny

pytestmark = pytest.mark.e2e


def _fresh(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)


def _warm_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    res = _warm().run(args, str(cwd), {**os.environ, "OMP_NUM_THREADS": "1"}, 600)
    assert res is not None, "the warm interpreter refused a command of this checkout under the worker's environment"
    return res


def _figures(run: Path) -> list[dict[str, str]]:
    import csv

    with open(run / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in csv.DictReader(f)]


def test_a_run_and_its_evaluation_write_the_same_warm_as_fresh(corpus: Path, tmp_path: Path) -> None:
    args = tiny(corpus, tmp_path / "cache", "trainer.max_steps=4", "trainer.val_check_interval=2", "logger=csv")
    runs = {}
    for how, run_it in (("fresh", _fresh), ("warm", _warm_run)):
        run = tmp_path / how
        res = run_it([str(ROOT / "train.py"), *args, f"hydra.run.dir={run}"], tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.strip().splitlines()[-1].endswith(f"-> {run}/summary.json"), res.stdout[-500:]
        ev = run_it([str(ROOT / "eval.py"), f"run={run}"], tmp_path)
        assert ev.returncode == 0, ev.stderr[-3000:]
        runs[how] = run, res.stdout.replace(str(run), "RUN"), ev.stdout.replace(str(run), "RUN")
    (fresh, fresh_out, fresh_eval), (warm, warm_out, warm_eval) = runs["fresh"], runs["warm"]
    assert _figures(warm) == _figures(fresh)
    a, b = (json.loads((r / "summary.json").read_text()) for r in (fresh, warm))
    assert a.keys() == b.keys() and a["status"] == b["status"] == "completed"
    assert (a["steps"], a["final_val_loss"], a["val_curve"]) == (b["steps"], b["final_val_loss"], b["val_curve"])
    assert warm_out.splitlines()[-1] == fresh_out.splitlines()[-1]  # step, losses, where the summary is
    prepared = "prepared in"  # the first command to need the evaluation's shards prepares them: fresh's, here
    assert [line for line in warm_eval.splitlines() if prepared not in line] == \
        [line for line in fresh_eval.splitlines() if prepared not in line]
    assert sorted(p.name for p in warm.iterdir()) == sorted(p.name for p in fresh.iterdir())


def test_a_refusal_says_the_same_and_exits_the_same(tmp_path: Path) -> None:
    for args in ([str(ROOT / "train.py"), "norm=rsm"], ["-m", "lmlab", "nonsense"],
                 [str(ROOT / "eval.py"), f"run={tmp_path / 'nothing'}"]):
        fresh, warm = _fresh(args, tmp_path), _warm_run(args, tmp_path)
        assert fresh.returncode != 0 and (warm.returncode, warm.stderr) == (fresh.returncode, fresh.stderr), args
        assert warm.stdout == fresh.stdout


def test_a_command_it_cannot_run_as_a_new_interpreter_would_is_left_to_one(tmp_path: Path) -> None:
    warm, env = _warm(), {**os.environ, "OMP_NUM_THREADS": "1"}
    script = tmp_path / "train.py"
    script.write_text("print('another checkout')\n")
    assert warm.run([str(script)], str(tmp_path), env, 60) is None  # its own imports, not this checkout's
    assert warm.run(["-m", "json.tool", "--help"], str(tmp_path), env, 60) is None  # not an lmlab command
    assert warm.run([str(ROOT / "train.py"), "--help"], str(tmp_path), {**env, "HF_HOME": str(tmp_path)}, 60) is None
    assert warm.run([str(ROOT / "train.py"), "--help"], str(tmp_path), {**env, "PYTEST_CURRENT_TEST": "x"}, 60)


def test_a_command_past_its_timeout_is_killed_and_the_next_one_runs(corpus: Path, tmp_path: Path) -> None:
    """As subprocess.run: the command is killed at its timeout and TimeoutExpired raised; the server goes on."""
    warm, env = _warm(), {**os.environ, "OMP_NUM_THREADS": "1"}
    long = [str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache", "trainer.max_steps=100000"),
            f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(subprocess.TimeoutExpired):
        warm.run(long, str(tmp_path), env, 3)
    res = warm.run([str(ROOT / "train.py"), "--help"], str(tmp_path), env, 60)
    assert res.returncode == 0 and "train" in res.stdout
