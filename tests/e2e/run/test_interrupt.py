"""Interruption: SIGINT, SIGTERM and SIGUSR1 end the current step, save a checkpoint at that boundary, write
`interrupted` and exit non-zero; resuming gives exactly the uninterrupted run's metrics.csv, every row and column."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from lmlab import compose
from lmlab.record.metrics_csv import read_rows
from lmlab.run.training import train
from tests.runs import ROOT, cli, figures, tiny


class _Signal(Callback):
    """Sends a real signal to this process when step `at` starts (the handler sees it mid-step)."""

    def __init__(self, signum: int, at: int) -> None:
        self.signum, self.at = signum, at

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            os.kill(os.getpid(), self.signum)


@pytest.fixture
def straight(tiny_straight: Path) -> tuple[Path, Path]:
    """The plain tiny run trained straight through (tests/e2e/conftest.py) and its data cache."""
    return tiny_straight, tiny_straight.parent / "cache"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_signal_at_a_random_step_then_resume_gives_the_same_metrics(straight, corpus, tmp_path, signum) -> None:
    run_straight, cache = straight
    at = int(os.environ.get("LMLAB_TEST_AT", 0)) or random.SystemRandom().randint(1, 28)  # seeded `random` is not
    run = tmp_path / "run"
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    summary = train(compose(tiny(corpus, cache)), run, callbacks=[_Signal(signum, at)])
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are given back
    assert summary["status"] == "interrupted" and summary["signal"] == signum
    assert summary["steps"] == at + 1, at  # the step the signal came in was finished, then the run stopped
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["status"] == "interrupted" and on_disk["steps"] == at + 1
    summary = train(compose(tiny(corpus, cache)), run)  # resume=auto
    assert summary["status"] == "completed" and summary["steps"] == 30
    assert figures(run) == figures(run_straight), f"signal at step {at}"
    assert [a["status"] for a in summary["attempts"]] == ["interrupted", "completed"]


def _wait_for(ready: Callable[[], bool], proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    """Until `ready()`, while train.py runs."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, f"{what} never came"
        time.sleep(0.02)


def _has_step(metrics: Path, step: int) -> bool:
    """metrics.csv has a whole row for `step` or later (read_rows leaves out a row still being written)."""
    return metrics.exists() and any(row["step"] >= step for row in read_rows(metrics))


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (the kernel's SigCgt mask): lmlab's is installed."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    mask = int(next(line for line in status.splitlines() if line.startswith("SigCgt:")).split()[1], 16)
    return bool(mask >> (signum - 1) & 1)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # a thread that ended while we looked
            continue
    return out


def _rank_1(pid: int, signum: int) -> int | None:
    """train.py's rank-1 process once lmlab's handler for `signum` is in it: the child Lightning started with
    LOCAL_RANK=1. Not merely a child that catches the signal: a fork of train.py before its exec (ldconfig, git: run by
    ctypes and tracking.code_version) may too, for a moment a loaded machine stretches, and is gone a moment later."""
    for child in _children(pid):
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except (FileNotFoundError, ProcessLookupError):
            continue
        if b"LOCAL_RANK=1" in environ and _catches(child, signum):
            return child
    return None


def _interrupt_cli(args: list[str], run: Path, cwd: Path, signum: int, to_child: bool = False, twice: bool = False
                   ) -> subprocess.CompletedProcess:
    """Start train.py, send `signum` a random moment after training starts (to rank 1 with to_child; `twice`: again
    a moment later, as Ctrl-C pressed twice), wait."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args, f"hydra.run.dir={run}"], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for((run / ".hydra" / "config.yaml").exists, proc, "config.yaml")  # written once every check has passed
        target = proc.pid
        if to_child:
            _wait_for(lambda: _rank_1(proc.pid, signum) is not None, proc, "rank 1's signal handler")  # in train()
            target = _rank_1(proc.pid, signum)
        # training has taken a step (set-up time is no clock on a loaded machine: a signal before the first step ends
        # the run at once, with nothing to resume; and the second Ctrl-C stops at once, inside training). Not the file
        # alone: it appears with step 0's figures, and a loaded machine's first step outlasted the sleep below
        _wait_for(lambda: _has_step(run / "metrics.csv", 2), proc, "a row for step 2 in metrics.csv")
        time.sleep(random.uniform(0.1, 0.8) if to_child else random.uniform(0.5, 1.5))  # somewhere in training
        os.kill(target, signum)
        if twice:
            time.sleep(0.01)
            os.kill(target, signum)
        out, err = proc.communicate(timeout=300)  # no hang
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_sigterm_to_train_py_exits_non_zero_and_resumes_exactly(corpus: Path, tmp_path: Path) -> None:
    args = tiny(corpus, tmp_path / "cache", "trainer.max_steps=600", "trainer.val_check_interval=200",
                "monitor.every_n_steps=50", "monitor.attn_every_n_steps=100")
    straight = tmp_path / "straight"  # the reference, trained in this process
    assert train(compose(args), straight)["status"] == "completed"
    run = tmp_path / "run"
    res = _interrupt_cli(args, run, tmp_path, signal.SIGTERM)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted", res.stderr[-3000:]
    assert res.returncode == 128 + signal.SIGTERM, res.stderr[-3000:]
    assert 0 < summary["steps"] < 600
    assert f"hydra.run.dir={run}" in res.stdout  # the one line that says how to continue
    res = cli(str(ROOT / "train.py"), *args, f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert figures(run) == figures(straight), summary["steps"]


def test_ctrl_c_pressed_twice_exits_130_and_resumes_to_one_row_per_step(corpus: Path, tmp_path: Path) -> None:
    """The second Ctrl-C stops at once, mid-step: the run is `interrupted` with exit code 130 as for one Ctrl-C (it
    was 1), and the resumed metrics.csv has each step once (a step read back as text was compared with an integer
    and its row written twice)."""
    args = tiny(corpus, tmp_path / "cache", "trainer.max_steps=600", "trainer.val_check_interval=200",
                "monitor.every_n_steps=50", "monitor.attn_every_n_steps=100")
    run = tmp_path / "run"
    res = _interrupt_cli(args, run, tmp_path, signal.SIGINT, twice=True)
    assert (run / "summary.json").is_file(), res.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert res.returncode == 130 and summary["status"] == "interrupted" and summary["signal"] == signal.SIGINT, \
        res.stderr[-3000:]
    res = cli(str(ROOT / "train.py"), *args, f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = [int(row["step"]) for row in figures(run)]
    assert steps == sorted(set(steps)) and steps[-1] == 599, summary["steps"]


def test_a_signal_to_one_ddp_rank_stops_both_without_a_hang(corpus: Path, tmp_path: Path) -> None:
    """2 CPU ranks (gloo): SIGTERM to rank 1 only; both stop after the same step, the collective save completes,
    rank 0 exits non-zero, and the resumed run's metrics equal the uninterrupted 2-rank run's."""
    args = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "data.batch"))]
    # 200 steps: the signal lands 0.1-0.8 s into training, a few dozen steps of two ranks on a loaded 2-core machine
    args += ["trainer.max_steps=200", "trainer.val_check_interval=50", "data.batch_size=4", "monitor.every_n_steps=25",
             "monitor.attn_every_n_steps=50", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.strategy=ddp"]
    straight = tmp_path / "straight"
    res = cli(str(ROOT / "train.py"), *args, f"hydra.run.dir={straight}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    run = tmp_path / "run"
    res = _interrupt_cli(args, run, tmp_path, signal.SIGTERM, to_child=True)
    assert (run / "summary.json").exists(), (res.returncode, res.stdout[-2000:], res.stderr[-3000:])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["world_size"] == 2, res.stderr[-3000:]
    assert res.returncode == 128 + signal.SIGTERM and 0 < summary["steps"] < 200, res.stderr[-3000:]
    res = cli(str(ROOT / "train.py"), *args, f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert figures(run) == figures(straight), summary["steps"]


def _slurm_env(monkeypatch, tmp_path: Path) -> Path:
    """A SLURM batch job's environment, with a stand-in `scontrol` that records how it was called (there is no
    cluster here; the command line is what lmlab controls)."""
    calls = tmp_path / "scontrol_calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    for key, value in {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "lmlab", "SLURM_JOB_ID": "4242", "SLURM_PROCID": "0",
                       "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost",
                       "SLURM_NTASKS_PER_NODE": "1"}.items():
        monkeypatch.setenv(key, value)
    return calls


def test_sigusr1_under_slurm_saves_once_and_requeues(straight, corpus, tmp_path, monkeypatch) -> None:
    """SLURM's warning before the time limit: lmlab saves its checkpoint at the step boundary and requeues the job
    itself (Lightning's own handler, which would write a second, hpc_ckpt_N.ckpt, is kept out); the requeued job
    (same arguments, resume=auto) continues to the uninterrupted run's metrics."""
    run_straight, cache = straight
    calls = _slurm_env(monkeypatch, tmp_path)
    run = tmp_path / "run"
    summary = train(compose(tiny(corpus, cache)), run, callbacks=[_Signal(signal.SIGUSR1, 12)])
    assert summary["status"] == "interrupted" and summary["steps"] == 13
    assert calls.read_text().split() == ["requeue", "4242"]
    assert not list(run.rglob("hpc_ckpt_*.ckpt"))
    summary = train(compose(tiny(corpus, cache)), run)  # the requeued job
    assert summary["status"] == "completed"
    assert figures(run) == figures(run_straight)


def test_resume_takes_the_newest_checkpoint_lightnings_hpc_one_included(corpus, tmp_path) -> None:
    cache = tmp_path / "cache"
    ahead = tmp_path / "ahead"
    train(compose(tiny(corpus, cache, "trainer.max_steps=20")), ahead)
    run = tmp_path / "run"
    train(compose(tiny(corpus, cache, "trainer.max_steps=10")), run)
    hpc = run / "hpc_ckpt_1.ckpt"  # where Lightning's SLURM handler saves (default_root_dir)
    hpc.write_bytes((ahead / "checkpoints" / "last.ckpt").read_bytes())
    later = (run / "checkpoints" / "last.ckpt").stat().st_mtime + 10
    os.utime(hpc, (later, later))
    summary = train(compose(tiny(corpus, cache, "trainer.max_steps=30")), run)
    assert summary["steps"] == 30 and summary["attempts"][-1]["from_step"] == 20


_SLOW_FIRST_BATCH = """
import sys, time
from lightning.pytorch.callbacks import Callback
from lmlab import compose
from lmlab.run.training import train

class SlowFirstBatch(Callback):  # the first batch takes minutes to assemble (a slow disk, a huge first document)
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == int(sys.argv[2]):
            print("assembling the first batch", flush=True)
            time.sleep(300)

train(compose(sys.argv[3:]), sys.argv[1], callbacks=[SlowFirstBatch()])
"""


@pytest.mark.parametrize("at", [0, 8], ids=["fresh", "resumed"])
def test_sigterm_while_the_first_batch_is_assembled_ends_the_run_within_seconds(corpus: Path, tmp_path: Path,
                                                                                at: int, tiny_straight: Path) -> None:
    """A SIGTERM while an attempt's first batch takes minutes ends the run at once (it waited for the end of that
    step): `interrupted`, exit code 143, the checkpoint it started from kept; continued, it is the straight run."""
    args = tiny(corpus, tmp_path / "cache")
    run = tmp_path / "run"
    if at:  # an earlier attempt was stopped after 8 steps
        from tests.runs import CtrlC

        with pytest.raises(SystemExit):
            train(compose(args), run, callbacks=[CtrlC(at=at)])
        args = [*args, "resume=true"]
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_FIRST_BATCH, str(run), str(at), *args], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # a resume says first what it continues
            if line.strip() == "assembling the first batch":
                break
        else:
            pytest.fail(proc.stderr.read()[-3000:])
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    err = proc.stderr.read()
    assert proc.returncode == 128 + signal.SIGTERM and took < 10, (proc.returncode, took, err[-3000:])
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["signal"] == signal.SIGTERM and summary["steps"] == at
    train(compose([*tiny(corpus, tmp_path / "cache")]), run)  # resume=auto: continues (or starts) as it was
    assert figures(run) == figures(tiny_straight)  # the straight run (its own data cache: the same tokens)
