"""`lmlab sweep status|resume` without training: --watch prints again until no job is pending or running, --json
for scripts, and a directory without a manifest is refused naming what it is."""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from lmlab.commands import main
from lmlab.commands.sweep import status
from tests.unit.record.test_sweep import _job, _manifest, _summary


def test_watch_prints_again_until_no_job_is_pending_or_running(tmp_path: Path, capsys) -> None:
    _manifest(tmp_path, [_job("a", 0)], os.getpid())  # a live submitter: the job is pending
    finish = threading.Timer(0.6, lambda: _summary(tmp_path / "a", "completed", 100))
    finish.start()
    try:
        rows = status(tmp_path, watch=0.1)
    finally:
        finish.cancel()
    out = capsys.readouterr().out
    assert rows[0]["state"] == "completed" and out.count("1 job(s): 1 pending") >= 2, out
    assert out.rstrip().endswith("1 job(s): 1 completed")


def test_json_for_scripts_and_a_directory_without_a_manifest_is_refused(tmp_path: Path, capsys) -> None:
    _manifest(tmp_path, [_job("a", 0, "4_0")], os.getpid())
    _summary(tmp_path / "a", "diverged", 40)
    main(["sweep", "status", str(tmp_path), "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["counts"] == {"diverged": 1} and out["jobs"][0]["scheduler_id"] == "4_0"
    with pytest.raises(SystemExit) as stop:
        main(["sweep", "resume", str(tmp_path / "nothing")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "has no sweep.json: not the directory of a sweep" in err, err


def test_resume_refuses_a_hostile_recorded_command_before_anything_runs(tmp_path: Path, capsys,
                                                                       dead_pid: int) -> None:
    """A shared sweep directory's sweep.json whose command would write a file when composed: refused, exit 2,
    nothing written (the job is `not started`, so the resume would otherwise run the command)."""
    from lmlab.record import sweep

    marker = tmp_path / "pwned"
    _manifest(tmp_path, [_job("a", 0)], dead_pid)
    manifest = json.loads(sweep.path_of(tmp_path).read_text())
    manifest["command"] = ["python train.py", "-m", "seed=1,2",
                           f"+trainer.plugins={{_target_:lmlab.record.rundir.atomic_write,path:{marker},data:x}}"]
    sweep.path_of(tmp_path).write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as stop:
        main(["sweep", "resume", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "command[3]" in err and "instantiation keys are not data" in err, err
    assert not marker.exists() and not (tmp_path / "a").exists()


@pytest.mark.parametrize("args", [
    ["+perf.tag=create", "trainer.strategy='${oc.${perf.tag}:\"{_target_: lmlab.record.rundir.atomic_write, "
                         "path: MARKER, data: x}\"}'"],  # a resolver named by an interpolation (issue 59, 1)
    ["hydra/sweeper=optuna", "hydra.sweeper.direction='${oc.create:\"{_target_: lmlab.record.rundir.atomic_write, "
                                                       "path: MARKER, data: x}\"}'"],  # Hydra's sweeper settings (2)
    ["hydra/launcher=slurm", "trainer.devices=1", "hydra.launcher.comment='x\ntouch MARKER'"],  # an sbatch line (4)
    ["downstream.tasks=[MARKER.yaml]"],  # a task file whose !function imports code beside it (5)
    ["hydra.sweep.subdir=../../MARKER"],  # job directories outside the sweep
])
def test_resume_refuses_what_the_fourth_probe_ran_through_a_recorded_command(tmp_path: Path, capsys, dead_pid: int,
                                                                            monkeypatch, args: list[str]) -> None:
    """Issue 59's Critical forms in a shared sweep's sweep.json, through `lmlab sweep resume`: refused, exit 2, the
    file and argument named, nothing written or run — with a stand-in `sbatch` on PATH that would run its script."""
    from lmlab.record import sweep

    marker = tmp_path / "pwned"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text("#!/bin/sh\nsh \"$@\"\necho 'Submitted batch job 1'\n")
    (bin_dir / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    _manifest(tmp_path, [_job("a", 0)], dead_pid)
    manifest = json.loads(sweep.path_of(tmp_path).read_text())
    manifest["command"] = ["python train.py", "-m", "seed=1,2", *(a.replace("MARKER", str(marker)) for a in args)]
    sweep.path_of(tmp_path).write_text(json.dumps(manifest))
    with pytest.raises(SystemExit) as stop:
        main(["sweep", "resume", str(tmp_path)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"{sweep.path_of(tmp_path)}: command[" in err and "is refused" in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert not marker.exists() and not (tmp_path / "a").exists()


def test_a_malformed_manifest_is_one_line(tmp_path: Path, capsys) -> None:
    from lmlab.record import sweep

    for text in ("[" * 100_000 + "]" * 100_000, '{"jobs": [5]}', '{"jobs": [{"dir": "../../x"}]}'):
        sweep.path_of(tmp_path).write_text(text)
        for action in ("status", "resume"):
            with pytest.raises(SystemExit) as stop:
                main(["sweep", action, str(tmp_path)])
            err = capsys.readouterr().err
            assert stop.value.code == 2 and len(err.strip().splitlines()) == 1 and "sweep.json" in err, err


def test_a_job_directory_that_links_outside_the_sweep_is_not_written_through(tmp_path: Path, capsys,
                                                                             dead_pid: int) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    sweep_dir = tmp_path / "sweep"
    sweep_dir.mkdir()
    (sweep_dir / "a").symlink_to(outside)
    _manifest(sweep_dir, [_job("a", 0)], dead_pid)
    with pytest.raises(SystemExit) as stop:
        main(["sweep", "resume", str(sweep_dir)])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "leads outside the sweep" in err, err
    assert list(outside.iterdir()) == []


def test_compare_without_a_directory_says_what_to_name(capsys) -> None:
    """`lmlab compare` alone: its own usage in one line, exit 2 (not eval's `run=`/`compare=` keys)."""
    with pytest.raises(SystemExit) as stop:
        main(["compare"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith("lmlab compare: name the sweep or run directories")
    assert "lmlab eval" not in err and "run=" not in err
