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
