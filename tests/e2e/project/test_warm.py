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

from tests.runs import ROOT, figures, tiny, warm

pytestmark = pytest.mark.e2e


def _fresh(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=cwd, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)


def _warm_run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = warm(env).run(args, str(cwd), env, 600)
    assert res is not None, "the warm interpreter refused a command of this checkout under its own environment"
    return res


def _lines(text: str, run: Path) -> list[str]:
    """Output as lines with the run directory and every number masked (times, speeds), less the line that says
    the shards were prepared (the first command to need them prepares them: fresh's, here)."""
    import re

    return [re.sub(r"\d+(\.\d+)?(e-?\d+)?", "#", line) for line in text.replace(str(run), "RUN").splitlines()
            if "prepared in" not in line]


def test_a_run_and_its_evaluation_write_the_same_warm_as_fresh(corpus: Path, tmp_path: Path) -> None:
    """The same figures and summary, and the same lines on stdout and on stderr (logging's among them: under Hydra
    it goes to stdout, and Lightning's would go to stderr had it been imported before the root logger had a handler,
    as tests/warm.py takes care it is not)."""
    args = tiny(corpus, tmp_path / "cache", "trainer.max_steps=4", "trainer.val_check_interval=2", "logger=csv")
    out = {}
    for how, run_it in (("fresh", _fresh), ("warm", _warm_run)):
        run = tmp_path / how
        res = run_it([str(ROOT / "train.py"), *args, f"hydra.run.dir={run}"], tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        ev = run_it(["-m", "lmlab", "eval", f"run={run}"], tmp_path)
        assert ev.returncode == 0, ev.stderr[-3000:]
        out[how] = [_lines(text, run) for text in (res.stdout, res.stderr, ev.stdout, ev.stderr)]
    fresh, warm = tmp_path / "fresh", tmp_path / "warm"
    assert figures(warm) == figures(fresh)
    a, b = (json.loads((r / "summary.json").read_text()) for r in (fresh, warm))
    assert a.keys() == b.keys() and a["status"] == b["status"] == "completed"
    assert (a["steps"], a["final_val_loss"], a["val_curve"]) == (b["steps"], b["final_val_loss"], b["val_curve"])
    for stream, fresh_lines, warm_lines in zip(("train's stdout", "train's stderr", "eval's stdout", "eval's stderr"),
                                               out["fresh"], out["warm"]):
        assert warm_lines == fresh_lines, stream
    assert any(line.startswith("data=text_files") for line in out["fresh"][0])  # lmlab's logging, on stdout
    assert sorted(p.name for p in warm.iterdir()) == sorted(p.name for p in fresh.iterdir())


def test_a_refusal_says_the_same_and_exits_the_same(tmp_path: Path) -> None:
    for args in ([str(ROOT / "train.py"), "norm=rsm"], ["-m", "lmlab", "eval"],
                 [str(ROOT / "eval.py"), f"run={tmp_path / 'nothing'}"]):
        fresh, warm = _fresh(args, tmp_path), _warm_run(args, tmp_path)
        assert fresh.returncode != 0 and (warm.returncode, warm.stderr) == (fresh.returncode, fresh.stderr), args
        assert warm.stdout == fresh.stdout


def test_a_command_it_cannot_run_as_a_new_interpreter_would_is_left_to_one(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = warm(env)
    script = tmp_path / "train.py"
    script.write_text("print('another checkout')\n")
    assert server.run([str(script)], str(tmp_path), env, 60) is None  # its own imports, not this checkout's
    assert server.run(["-m", "json.tool", "--help"], str(tmp_path), env, 60) is None  # not an lmlab command
    assert server.run(["-m", "lmlab.record.consolidate", "--help"], str(tmp_path), env, 60) is None  # not Hydra's
    other = {**env, "HF_HOME": str(tmp_path)}  # an import reads it: not this server's
    assert server.run([str(ROOT / "train.py"), "--help"], str(tmp_path), other, 60) is None
    assert server.run([str(ROOT / "train.py"), "--help"], str(tmp_path), {**env, "PYTEST_CURRENT_TEST": "x"}, 60)
    again = warm(other)  # tests.runs.cli's: a server started under the command's environment, the old one ended
    assert again is not server and server.proc.poll() is not None and again.imported_under(other)
    res = again.run([str(ROOT / "train.py"), "--help"], str(tmp_path), other, 60)
    assert res.returncode == 0 and "train" in res.stdout


def test_a_command_past_its_timeout_is_killed_and_the_next_one_runs(corpus: Path, tmp_path: Path) -> None:
    """As subprocess.run: the command is killed at its timeout and TimeoutExpired raised; the server goes on."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = warm(env)
    long = [str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache", "trainer.max_steps=100000"),
            f"hydra.run.dir={tmp_path / 'run'}"]
    with pytest.raises(subprocess.TimeoutExpired):
        server.run(long, str(tmp_path), env, 3)
    res = server.run([str(ROOT / "train.py"), "--help"], str(tmp_path), env, 60)
    assert res.returncode == 0 and "train" in res.stdout
