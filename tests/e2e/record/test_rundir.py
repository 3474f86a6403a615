"""The run directory as a lab notebook: safe loading, refusals that change nothing, failures that lose nothing,
one process at a time, strict JSON, and incomplete runs that compare still shows."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lmlab import compose
from lmlab.record.rundir import CheckpointError, RunDirBusy, RunLock, load_checkpoint
from lmlab.run.training import train
from tests.runs import ROOT, cli, metric, tiny


def snapshot(run: Path) -> dict[str, str]:
    """sha256 of every file under the run directory."""
    return {str(p.relative_to(run)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(run.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(corpus: Path, tmp_path_factory) -> tuple[Path, Path]:
    """A completed 20-step run (val every 10) and its data cache; tests copy it before changing anything."""
    base = tmp_path_factory.mktemp("finished")
    run = base / "run"
    train(compose(tiny(corpus, base / "cache", "trainer.max_steps=20")), run)
    return run, base / "cache"


def copy_run(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


class _Evil:
    """Unpickling this creates a file: what a hostile checkpoint would do (run a shell command, say)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def plant_evil_checkpoint(run: Path, marker: Path) -> None:
    state = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    state["payload"] = _Evil(marker)
    torch.save(state, run / "checkpoints" / "last.ckpt")


def test_a_checkpoint_that_would_run_code_is_refused_everywhere(finished, corpus: Path, tmp_path: Path) -> None:
    src, cache = finished
    run = copy_run(src, tmp_path / "run")
    marker = tmp_path / "pwned"
    plant_evil_checkpoint(run, marker)
    # eval (the CLI)
    res = cli(str(ROOT / "eval.py"), f"run={run}", cwd=tmp_path)
    assert res.returncode != 0 and "weights_only" in res.stderr and "last.ckpt" in res.stderr, res.stderr[-2000:]
    # resume
    with pytest.raises(CheckpointError, match="refused .*last.ckpt"):
        train(compose(tiny(corpus, cache, "trainer.max_steps=30", "resume=true")), run)
    # init_from
    with pytest.raises(CheckpointError, match="init_from=.*refused"):
        train(compose(tiny(corpus, cache, f"init_from={run}")), tmp_path / "other")
    assert not marker.exists()


@pytest.mark.parametrize("damage", ["truncated", "empty", "not a checkpoint", "not lmlab's"])
def test_a_damaged_checkpoint_is_refused_with_its_path(finished, tmp_path: Path, damage: str) -> None:
    path = tmp_path / "last.ckpt"
    data = (finished[0] / "checkpoints" / "last.ckpt").read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "not a checkpoint":
        path.write_text("hello, I am a text file\n")
    else:
        torch.save({"weights": torch.zeros(3)}, path)
    with pytest.raises(CheckpointError, match=f"run=x: .*{path}") as err:
        load_checkpoint(path, "run=x")
    assert "Traceback" not in str(err.value)


def test_a_refused_resume_changes_no_file(finished, corpus: Path, tmp_path: Path) -> None:
    src, cache = finished
    run = copy_run(src, tmp_path / "run")
    before = snapshot(run)
    other = tmp_path / "other_corpus"
    other.mkdir()
    (other / "c.txt").write_text("completely different text with other letters: xyz QWERTY 0123456789\n" * 400)
    with pytest.raises(ValueError, match="another tokenizer"):  # another corpus -> another char vocabulary
        train(compose(tiny(other, cache, "trainer.max_steps=30", "resume=true")), run)
    with pytest.raises(ValueError, match="model/norm"):
        train(compose(tiny(corpus, cache, "trainer.max_steps=30", "norm=rms")), run)
    assert snapshot(run) == before


class _Fail(Callback):
    def on_train_batch_start(self, trainer, *args) -> None:
        raise RuntimeError("out of memory (planted)")


def test_a_resume_that_fails_keeps_the_record(finished, corpus: Path, tmp_path: Path) -> None:
    src, cache = finished
    run = copy_run(src, tmp_path / "run")
    before = snapshot(run)
    old = json.loads((run / "summary.json").read_text())
    with pytest.raises(RuntimeError, match="planted"):
        train(compose(tiny(corpus, cache, "trainer.max_steps=30")), run, callbacks=[_Fail()])
    after = snapshot(run)
    changed = {k for k in before if before[k] != after.get(k)}
    assert changed <= {"summary.json", ".hydra/config.yaml", ".hydra/overrides.yaml"}, changed
    assert (run / "metrics.csv").read_bytes() == (src / "metrics.csv").read_bytes()  # every row kept
    new = json.loads((run / "summary.json").read_text())
    assert new["status"] == "failed" and "planted" in new["error"]
    for key in ("steps", "tokens", "final_val_loss", "best_val_loss", "peak_grad_norm", "grad_norm_at_init"):
        assert new[key] == old[key], key
    assert [(a["status"], a["from_step"], a["to_step"]) for a in new["attempts"]] == [
        ("completed", 0, 20), ("failed", 20, 20)]


def test_resume_modes(finished, corpus: Path, tmp_path: Path) -> None:
    src, cache = finished
    empty = tmp_path / "empty"
    with pytest.raises(FileNotFoundError, match=f"resume=true: {empty}/checkpoints/last.ckpt does not exist"):
        train(compose(tiny(corpus, cache, "resume=true")), empty)
    assert not any(empty.iterdir())  # nothing left behind
    run = copy_run(src, tmp_path / "run")
    before = snapshot(run)
    with pytest.raises(FileExistsError, match="already holds a run.*overwrite=true"):
        train(compose(tiny(corpus, cache, "trainer.max_steps=20", "resume=false")), run)
    # auto (the default) on a finished run: a no-op that loses nothing, not even the final val row
    summary = train(compose(tiny(corpus, cache, "trainer.max_steps=20")), run)
    assert summary["status"] == "completed" and snapshot(run) == before
    summary = train(compose(tiny(corpus, cache, "trainer.max_steps=20", "resume=true")), run)
    assert snapshot(run) == before
    # overwrite=true starts over
    summary = train(compose(tiny(corpus, cache, "trainer.max_steps=4", "resume=false", "overwrite=true")), run)
    assert summary["steps"] == 4 and sorted(metric(run, "train/loss")) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match=r"resume='maybe' is not an option; choose one of \['auto', 'true', 'false'\]"):
        train(compose(tiny(corpus, cache, "resume=maybe")), tmp_path / "x")


def test_init_from_a_missing_directory_names_init_from(corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=f"init_from={tmp_path / 'nope'}: no such run directory"):
        train(compose(tiny(corpus, tmp_path / "cache", f"init_from={tmp_path / 'nope'}")), tmp_path / "run")


def test_two_trainings_into_one_directory(corpus: Path, tmp_path: Path) -> None:
    """The second is refused at once, naming the holder; the first completes unharmed. The first is held still
    (SIGSTOP) from the moment it holds the lock until the second has been refused, then goes on (SIGCONT): it is
    mid-run whatever the machine's speed, so it needs no 2,000 steps to outlast the second's start (25 s of training
    it was; 200 steps here, with a row every 10th step and a validation at 100)."""
    run = tmp_path / "run"
    args = [str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache", "trainer.max_steps=200",
                                          "trainer.val_check_interval=100", "trainer.log_every_n_steps=10",
                                          "monitor.every_n_steps=0"), f"hydra.run.dir={run}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    first = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120  # held, with its line written (the file alone: it may not be locked yet)
        while f"pid {first.pid} " not in (RunLock.holder(run) or "") and time.time() < deadline:
            time.sleep(0.05)
        assert f"pid {first.pid} " in (RunLock.holder(run) or ""), RunLock.holder(run)
        first.send_signal(signal.SIGSTOP)  # mid-run, the lock held, until the second has been refused
        try:
            t0 = time.time()
            second = cli(*args, cwd=tmp_path)
            assert second.returncode != 0
            assert "is in use" in second.stderr and f"pid {first.pid}" in second.stderr, second.stderr[-2000:]
            assert time.time() - t0 < 30  # refused at once (the interpreter's start-up is most of it)
            assert first.poll() is None  # still running, its run not ended by the second
        finally:
            first.send_signal(signal.SIGCONT)
    finally:
        out, err = first.communicate(timeout=600)
    assert first.returncode == 0, err[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 200
    assert len(summary["attempts"]) == 1
    assert sorted(metric(run, "train/loss")) == list(range(9, 200, 10))  # Lightning logs every 10th step
    assert b"\x00" not in (run / "metrics.csv").read_bytes()
    assert not (run / ".lmlab.lock").exists()


def test_a_stale_lock_is_taken_over(tmp_path: Path) -> None:
    """A lock file left by a process that died (SIGKILL) holds no flock: the next run takes it."""
    code = f"from lmlab.record.rundir import RunLock; RunLock({str(tmp_path)!r}).acquire(); import os; os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True)  # exits without releasing: the file stays
    assert (tmp_path / ".lmlab.lock").exists() and RunLock.holder(tmp_path) is None
    with RunLock(tmp_path):
        assert RunLock.holder(tmp_path) is not None
        with pytest.raises(RunDirBusy, match=f"pid {os.getpid()}"):
            RunLock(tmp_path).acquire()
    assert not (tmp_path / ".lmlab.lock").exists()


def test_a_diverged_run_has_strict_json_and_eval_says_so(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(compose(tiny(corpus, tmp_path / "cache", "optim.lr=1e3", "optim.grad_clip=0",
                                 "divergence.spike_factor=0")), run)  # only a non-finite loss stops it
    assert summary["status"] == "diverged"
    text = (run / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))
    res = cli(str(ROOT / "eval.py"), f"run={run}", cwd=tmp_path)
    assert "diverged" in res.stdout + res.stderr


def test_compare_lists_incomplete_runs(finished, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    copy_run(finished[0], sweep / "done")
    killed = copy_run(finished[0], sweep / "killed")
    (killed / "summary.json").unlink()  # SIGKILL before the first summary: metrics and checkpoints only
    running = copy_run(finished[0], sweep / "running")
    (running / "summary.json").unlink()
    with RunLock(running):
        res = cli(str(ROOT / "eval.py"), f"compare={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    table = (sweep / "compare.md").read_text()
    for name, status in (("done", "completed"), ("killed", "killed"), ("running", "running")):
        row = next(line for line in table.splitlines() if f"| {name} |" in line)
        assert f"| {status} |" in row, row


SAVER = """
import sys, torch
from lmlab.record.rundir import atomic_checkpoint_io
atomic_checkpoint_io().save_checkpoint({"w": torch.zeros(2**27)}, sys.argv[1])  # 512 MB: a kill lands mid-write
"""


def test_a_checkpoint_write_killed_midway_leaves_its_temporary_beside_it_and_the_next_start_removes_it(
        tmp_path: Path) -> None:
    """SIGKILL while last.ckpt is written: nothing in $TMPDIR (Lightning's writer staged through a temporary file
    there, leaked at every kill), the old checkpoint intact, and the temporary gone once a run starts again."""
    from lmlab.record.rundir import RunDir

    run, tmpdir = tmp_path / "run", tmp_path / "tmpdir"
    (run / "checkpoints").mkdir(parents=True)
    tmpdir.mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(b"the previous checkpoint")
    env = {**os.environ, "TMPDIR": str(tmpdir), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SAVER, str(run / "checkpoints" / "last.ckpt")], env=env)
    deadline = time.time() + 120
    while not list((run / "checkpoints").glob(".last.ckpt.*.tmp")):
        assert proc.poll() is None and time.time() < deadline, "the save ended before it could be killed"
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    assert list(tmpdir.iterdir()) == []
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == b"the previous checkpoint"
    (killed,) = (run / "checkpoints").glob(".last.ckpt.*.tmp")
    assert killed.name == f".last.ckpt.lmlab-{proc.pid}.tmp"  # lmlab's marker and the writer's pid
    (run / "checkpoints" / ".last.ckpt.lmlab-99.old").mkdir()  # a sharded save killed between its two renames:
    (run / "checkpoints" / ".best.ckpt.lmlab-99.old").mkdir()  # best.ckpt/ was moved aside and not yet replaced
    (run / ".summary.json.123.tmp").write_text("{")  # the name lmlab wrote before the marker
    users = plant_users_files(run)
    removed = RunDir(run).clean_temporaries()
    assert sorted(p.name for p in removed) == sorted([".last.ckpt.lmlab-99.old", ".summary.json.123.tmp",
                                                      killed.name])
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == sorted(
        ["best.ckpt", "last.ckpt", *(p.name for p in users if p.parent.name == "checkpoints")])
    assert (run / "checkpoints" / "last.ckpt").read_bytes() == b"the previous checkpoint"
    assert_users_files(users)


def plant_users_files(run: Path) -> list[Path]:
    """A user's own hidden files in the run directory and checkpoints/, named as temporaries once were."""
    users = []
    for directory in (run, run / "checkpoints"):
        directory.mkdir(parents=True, exist_ok=True)
        (directory / ".notes.tmp").write_text("my notes")
        (directory / ".project.old").mkdir()
        (directory / ".project.old" / "a.txt").write_text("kept")
        (directory / ".draft.ckpt.old").mkdir()  # not a sharded checkpoint: not lmlab's
        (directory / ".notes.123.tmp").write_text("my notes")  # a pid-like number, but not a file lmlab writes
        users += [directory / n for n in (".notes.tmp", ".project.old", ".draft.ckpt.old", ".notes.123.tmp")]
    return users


def assert_users_files(users: list[Path]) -> None:
    for path in users:
        assert path.exists(), path
    for path in users:
        if path.name.startswith(".notes"):
            assert path.read_text() == "my notes"
        if path.name == ".project.old":
            assert (path / "a.txt").read_text() == "kept"


def test_a_start_and_a_resume_leave_a_users_hidden_files_alone(finished, corpus: Path, tmp_path: Path) -> None:
    """Starting a run used to delete or rename every `.*.tmp` / `.*.old` in the run directory and checkpoints/:
    a user's `.notes.tmp` and `.project.old/` survive a start and a resume, while a killed writer's temporary
    (lmlab's marker) still goes."""
    _, cache = finished
    run = tmp_path / "run"
    run.mkdir()
    (run / ".notes.tmp").write_text("my notes")
    (run / ".project.old").mkdir()
    (run / ".project.old" / "a.txt").write_text("kept")
    train(compose(tiny(corpus, cache, "trainer.max_steps=10")), run)  # a start: the directory held no run
    assert (run / ".notes.tmp").read_text() == "my notes" and (run / ".project.old" / "a.txt").read_text() == "kept"
    (run / ".notes.tmp").unlink()
    shutil.rmtree(run / ".project.old")
    users = plant_users_files(run)
    stale = run / "checkpoints" / ".last.ckpt.lmlab-4242.tmp"
    stale.write_bytes(b"half a checkpoint")
    summary = train(compose(tiny(corpus, cache, "trainer.max_steps=12")), run)  # a resume
    assert summary["status"] == "completed" and summary["steps"] == 12
    assert not stale.exists()
    assert_users_files(users)


def test_a_run_start_cleans_the_temporaries(finished, corpus: Path, tmp_path: Path) -> None:
    src, cache = finished
    run = copy_run(src, tmp_path / "run")
    stale = run / "checkpoints" / ".last.ckpt.lmlab-4242.tmp"
    stale.write_bytes(b"half a checkpoint")
    summary = train(compose(tiny(corpus, cache, "trainer.max_steps=22")), run)  # continues the finished run
    assert summary["status"] == "completed" and summary["steps"] == 22 and not stale.exists()


def test_a_summary_that_is_not_an_object_is_refused_with_its_path(tmp_path: Path) -> None:
    """eval.py run= on a run whose summary.json held a list died of an AttributeError; every reader goes through
    RunDir.read_summary, which now refuses it with the path."""
    from lmlab.record.rundir import RunDir

    run = RunDir(tmp_path)
    for text, kind in (("[1, 2]", "list"), ('"completed"', "str"), ("3", "int")):
        run.summary.write_text(text)
        with pytest.raises(ValueError, match=rf"{run.summary} holds a {kind}, not an object"):
            run.read_summary()
    run.summary.write_text('{"status": "completed"}')
    assert run.read_summary() == {"status": "completed"}


def test_a_value_from_the_environment_is_recorded_as_its_interpolation(corpus: Path, tmp_path: Path,
                                                                        monkeypatch) -> None:
    """`${oc.env:...}` values (tokens, passwords) were written in clear to summary.json: the record keeps the
    interpolation (as .hydra/config.yaml does), and the run itself used the value."""
    secret = tmp_path / "hunter2-cache"
    monkeypatch.setenv("LMLAB_TEST_SECRET", str(secret))
    run = tmp_path / "run"
    overrides = tiny(corpus, "${oc.env:LMLAB_TEST_SECRET}", "trainer.max_steps=2")
    summary = train(compose(overrides), run, overrides=overrides)
    assert summary["status"] == "completed" and (secret / "shards").is_dir()  # the value was used
    assert "hunter2" not in (run / "summary.json").read_text()
    assert "hunter2" not in (run / ".hydra" / "config.yaml").read_text()
    assert summary["config"]["data"]["cache_dir"] == "${oc.env:LMLAB_TEST_SECRET}"


def test_a_sigkilled_attempt_is_in_the_attempts(corpus: Path, tmp_path: Path) -> None:
    """SIGKILL leaves no summary, only the lock's line: the resume records that attempt as `killed`, from 0 to the
    checkpoint it continues from, before its own."""
    run = tmp_path / "run"
    args = [str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache", "trainer.max_steps=100000"), f"hydra.run.dir={run}"]
    proc = subprocess.Popen([sys.executable, *args], cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (run / "checkpoints" / "last.ckpt").is_file():
        assert proc.poll() is None and time.time() < deadline, "the run ended before it could be killed"
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    assert not (run / "summary.json").exists() and RunLock.holder(run) is None  # the lock's line is still there
    step = torch_step(run / "checkpoints" / "last.ckpt")
    res = cli(*args[:-2], f"hydra.run.dir={run}", "trainer.max_steps=" + str(step + 5), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    attempts = json.loads((run / "summary.json").read_text())["attempts"]
    assert [(a["status"], a["from_step"], a["to_step"]) for a in attempts] == [
        ("killed", 0, step), ("completed", step, step + 5)]
    assert f"pid {proc.pid} " in attempts[0]["holder"] and attempts[0]["started"]


def torch_step(ckpt: Path) -> int:
    return int(torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"])


@pytest.fixture
def small_disk(tmp_path: Path):
    """A 192 KiB filesystem (tmpfs; root only): room for a run's records, not for its checkpoint."""
    mount = tmp_path / "small"
    mount.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=192k", "tmpfs", str(mount)], capture_output=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({res.stderr.decode().strip()[:200]})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_one_line_naming_the_directory(corpus: Path, tmp_path: Path, small_disk: Path) -> None:
    """torch's zip writer says `unexpected pos 576 vs 534` when the disk fills: the run says which directory is full
    and what to do, in one line, exit 1; the records it could write are kept."""
    run = small_disk / "run"
    res = cli(str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache", "trainer.max_steps=4",
                                            "trainer.val_check_interval=2"), f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train.py: no space left on the device of {run / 'checkpoints'} to write "), last
    assert "the previous" in last and "hydra.run.dir=" in last
    assert (run / "metrics.csv").is_file() and not list(run.rglob(".*.tmp"))


def test_a_value_from_the_environment_with_a_default_reads_back_where_the_variable_is_unset(corpus: Path,
                                                                                            tmp_path: Path) -> None:
    """The default corpus's `data.cache_dir=${oc.env:LMLAB_CACHE,${oc.env:HOME}/.cache/lmlab}` was recorded without its
    default, so `eval.py run=` failed on every such run where LMLAB_CACHE is unset ("Environment variable
    'LMLAB_CACHE' not found"): the record keeps the default, still as text."""
    from lmlab.analysis.evaluate import evaluate

    cache = tmp_path / "cache"
    run = tmp_path / "run"
    overrides = tiny(corpus, f"${{oc.env:LMLAB_TEST_UNSET,{cache}}}", "trainer.max_steps=2")
    summary = train(compose(overrides), run, overrides=overrides)
    assert summary["config"]["data"]["cache_dir"] == f"${{oc.env:LMLAB_TEST_UNSET,'{cache}'}}"
    assert evaluate(run, lengths=[32])["rows"][0]["loss"] > 0
