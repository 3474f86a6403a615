"""Signals from the first line of `python train.py`: SIGTERM and SIGUSR1 are caught before torch is even imported
(lmlab.run.early_signals, the entry point's first call), and one that comes then stops the run before it starts with
the signal's exit code and a line that says so, instead of the signal's default killing the process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runs import ROOT, cli, tiny


def caught(pid: int) -> int:
    """The process's caught-signals mask (SigCgt in /proc/<pid>/status), 0 when it has gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_signal_before_torch_is_imported_stops_the_run_before_it_starts(signum, corpus: Path, tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache"),
                             f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        wanted = (1 << (signal.SIGTERM - 1)) | (1 << (signal.SIGUSR1 - 1)) | (1 << (signal.SIGINT - 1))
        deadline = time.time() + 60
        while caught(proc.pid) & wanted != wanted:  # the entry point's catch_early has run
            assert proc.poll() is None and time.time() < deadline, "train.py never caught SIGTERM and SIGUSR1"
            time.sleep(0.005)
        assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()  # caught before torch is loaded
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, err[-2000:]
    assert f"interrupted by signal {signum} before the run started: nothing to save" in out, out + err[-2000:]
    assert not (tmp_path / "run" / "summary.json").exists()  # nothing was started, so nothing to continue
    assert "Traceback" not in err and out.strip().splitlines()[-1].startswith("interrupted by signal"), err[-2000:]


@pytest.mark.parametrize("delay", [1.0, 2.5, 4.0])
def test_ctrl_c_during_the_start_up_is_one_line(delay: float, corpus: Path, tmp_path: Path) -> None:
    """Ctrl-C while train.py imports, checks or prepares its data (issue 59: a traceback of 40-100 lines): one line
    and 130, whenever it comes before the first step."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache"),
                             "trainer.max_steps=2000", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    if "interrupted: step" in out:  # a loaded machine had reached training: the run's own path (tests/e2e/run)
        pytest.skip("the run had started before the signal came")
    assert proc.returncode == 130, (out[-2000:], err[-2000:])
    assert out.strip().splitlines()[-1] == "interrupted by signal 2 before the run started: nothing to save", out
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]


def test_an_oversized_batch_is_refused_before_it_is_allocated(corpus: Path, tmp_path: Path) -> None:
    """data.batch_size=10^9 grew to many GB, deaf to signals, until the kernel killed it: refused in one line now,
    naming the key and the limit, before any data is read."""
    res = cli(str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache"), "data.batch_size=1000000000",
              f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=300)
    assert res.returncode == 2, res.stderr[-2000:]
    (line,) = res.stderr.strip().splitlines()
    assert "data.batch_size=1000000000 needs at least" in line and "the limit here is data.batch_size=" in line
    limit = int(line.split("the limit here is data.batch_size=")[1].split(";")[0])
    assert 1 <= limit < 1000000000
    assert not (tmp_path / "cache").exists() and not (tmp_path / "run" / "summary.json").exists()
