"""A sweep that owns its state, on a real SLURM scheduler: four jobs submitted fire-and-forget
(`hydra.launcher.wait=false`, the submitter gone at once), followed from other processes with `lmlab sweep status`,
one job cancelled and one killed mid-run, `lmlab sweep resume` finishing exactly those two to the metrics.csv of
uninterrupted runs, and a second resume that submits nothing; an Optuna search on SLURM that goes on past a failing
trial, records it as failed, and resumes. Skipped where no cluster answers (.ci/run starts one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from lmlab.record import sweep
from lmlab.record.rundir import RunLock
from tests.e2e.commands.test_search import _study
from tests.runs import ROOT, figures, tiny
from tests.slurm_cluster import env, slurm, start_sweep, wait_until  # noqa: F401  (slurm: the fixture)
from tests.unit.commands.test_search import _needs_optuna

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]

LONG = ("trainer.max_steps=600", "trainer.val_check_interval=100", "trainer.log_every_n_steps=10")


def status(d: Path) -> list[dict]:
    """`lmlab sweep status --json`, from a process of its own."""
    out = subprocess.run([sys.executable, "-m", "lmlab", "sweep", "status", str(d), "--json"], env=env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)["jobs"]


def resume(d: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmlab", "sweep", "resume", str(d), *extra], cwd=d.parent,
                          env=env(), capture_output=True, text=True, timeout=600)


def settled(d: Path) -> list[dict] | None:
    """The jobs once none is pending or running (None before)."""
    jobs = sweep.job_states(d)
    return None if any(j["state"] in sweep.ACTIVE for j in jobs) else jobs


def test_a_fire_and_forget_sweep_is_followed_and_resumes_exactly_the_jobs_that_did_not_finish(
        corpus: Path, tmp_path: Path) -> None:
    d = tmp_path / "sweep"
    proc, log = start_sweep(corpus, tmp_path / "cache", d, *LONG, "seed=1,2,3,4", "hydra.launcher.wait=false")
    assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]  # submitted, and gone
    out = log.read_text()
    assert "submitted 4 job(s)" in out and f"lmlab sweep status {d}" in out, out[-2000:]
    jobs = status(d)
    ids = [j["scheduler_id"] for j in jobs]
    assert len(jobs) == 4 and all(ids) and len(set(ids)) == 4, jobs
    assert {j["state"] for j in jobs} <= {"pending", "running", "completed"}, jobs

    subprocess.run(["scancel", ids[3]], check=True, timeout=30)  # the last job, cancelled (2 CPUs: still queued)
    killed = d / jobs[2]["dir"]
    wait_until(lambda: (sweep.job_states(d)[2]["step"] or 0) >= 200, 300, "job #2 mid-run")
    holder = RunLock.holder(killed)
    os.kill(int(holder.split()[1]), signal.SIGKILL)  # job #2's training process, mid-run ("pid N on host ...")
    jobs = wait_until(lambda: settled(d), 300, "every job ended")
    assert [j["state"] for j in jobs] == ["completed", "completed", "lost", "lost"], jobs
    assert 200 <= jobs[2]["step"] < 600 and jobs[2]["attempts"] == 1 and jobs[3]["attempts"] == 0

    first = resume(d)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    assert "2 job(s) to run: #2 (lost), #3 (lost)" in first.stdout and "submitted 2 job(s)" in first.stdout
    submissions = [j.get("submissions") for j in sweep.read(d)["jobs"]]
    second = resume(d)  # at once: the two are queued or running, nothing is submitted twice
    assert second.returncode == 0 and "nothing to resume" in second.stdout, second.stdout + second.stderr
    assert [j.get("submissions") for j in sweep.read(d)["jobs"]] == submissions == [1, 1, 2, 2]
    jobs = wait_until(lambda: settled(d), 300, "the resumed jobs ended")
    assert [(j["state"], j["step"]) for j in jobs] == [("completed", 600)] * 4, jobs
    assert [j["attempts"] for j in jobs] == [1, 1, 2, 1]  # the killed one continued from its checkpoint

    reference = tmp_path / "reference"  # the same two jobs, never interrupted, without SLURM
    ref = subprocess.run([sys.executable, str(ROOT / "train.py"), "-m",
                          *tiny(corpus, tmp_path / "cache", "trainer.accelerator=cpu", *LONG), "seed=3,4",
                          f"hydra.sweep.dir={reference}"], cwd=tmp_path, env=env(), capture_output=True, text=True,
                         timeout=600)
    assert ref.returncode == 0, ref.stderr[-3000:]
    by_seed = {j["seed"]: reference / j["dir"] for j in sweep.read(reference)["jobs"]}
    for job in sweep.read(d)["jobs"][2:]:
        assert figures(d / job["dir"]) == figures(by_seed[job["seed"]]), job["dir"]  # row for row, perf/ aside


def test_an_optuna_search_on_slurm_goes_on_past_a_failing_trial_and_resumes(corpus: Path, tmp_path: Path) -> None:
    """3 trials, each a SLURM job, the learning rate a choice of a diverging 1e3, a sane 3e-3 and an invalid 'abc'
    (that job is refused before it trains): the search goes on to its end, the refused trial is `failed` in the
    status with its reason (not lost), the command exits 1 listing it; `resume` adds the trial asked for."""
    optuna = _needs_optuna()
    d = tmp_path / "search"
    args = [a for a in tiny(corpus, tmp_path / "cache", "trainer.accelerator=cpu")
            if not a.startswith(("trainer.max_steps", "trainer.val_"))]
    command = [sys.executable, str(ROOT / "train.py"), "-m", "hparams_search=optuna", "hydra.sweeper.n_trials=3",
               *args, "trainer.max_steps=10", "trainer.val_check_interval=5", "optim.grad_clip=0",
               "optim.lr=choice(1000,0.003,abc)", "hydra.sweeper.sampler.seed=1", "hydra/launcher=slurm",
               f"hydra.sweep.dir={d}"]
    res = subprocess.run(command, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-3000:]
    assert "train.py: 1 job(s) of the sweep did not run to an end:" in res.stderr, res.stderr[-2000:]
    trials = _study(d).trials
    assert len(trials) == 3 and all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    jobs = status(d)
    states = {next(o for o in j["overrides"] if o.startswith("optim.lr=")): j for j in jobs}
    assert {k: j["state"] for k, j in states.items()} == {"optim.lr=1000": "diverged", "optim.lr=0.003": "completed",
                                                          "optim.lr=abc": "failed"}, jobs
    assert "must be a float" in states["optim.lr=abc"]["why"] and all(j["scheduler_id"] for j in jobs)

    resumed = resume(d, "hydra.sweeper.n_trials=1")
    assert resumed.returncode in (0, 1), resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert len(_study(d).trials) == 4 and len(status(d)) >= 3
