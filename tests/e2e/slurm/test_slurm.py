"""Sweeps on a real SLURM scheduler (hydra/launcher=slurm): a sweep that completes and says so, a failed job the
sweep goes on past, a refused request, SIGUSR1 (the time-limit warning) that saves, requeues and resumes to the
uninterrupted run's metrics.csv, a plain scancel that the same command continues, 2-rank CPU DDP, and the real time
limit. Skipped where no cluster answers (`.ci/run` starts a local one: scripts/local_slurm.sh)."""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path

import pytest

from lmlab import compose
from lmlab.run.training import train
from tests.runs import figures, tiny
from tests.slurm_cluster import (
    interrupt_midway,
    run_sweep,
    show_job,
    slurm,  # noqa: F401  (the fixture)
    start_sweep,
    submitted_job,
    wait_until,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]  # skipped without a cluster

# one run long enough to be signalled mid-way (~1500 steps of the tiny model: ~20 s of training)
LONG = ("trainer.max_steps=1500", "trainer.val_check_interval=100", "trainer.log_every_n_steps=10",
        "monitor.every_n_steps=50", "monitor.attn_every_n_steps=100")


def summaries(sweep_dir: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sweep_dir.glob("*/summary.json")}


def job_lines(output: str) -> list[str]:
    """The report's lines, one per job (the state changes printed while waiting are not)."""
    return [line for line in output.splitlines()
            if re.match(r"slurm job \S+( \[.*\])?: (completed|diverged|collapsed|interrupted|failed)", line)]


@pytest.fixture(scope="module")
def reference(corpus: Path, tmp_path_factory) -> Path:
    """The LONG run, uninterrupted and without SLURM: the curve every interrupted job must end with."""
    d = tmp_path_factory.mktemp("reference")  # trained in this process: no interpreter to start for a reference
    summary = train(compose(tiny(corpus, d / "cache", "trainer.accelerator=cpu", *LONG)), d / "run")
    assert summary["status"] == "completed", summary
    return d / "run"


def test_a_sweep_ends_completed_with_one_line_per_job(corpus: Path, tmp_path: Path) -> None:
    start = time.time()
    result = run_sweep(corpus, tmp_path / "cache", tmp_path / "sweep", "placement=pre,post")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = job_lines(result.stdout)
    assert len(lines) == 2, result.stdout
    for placement, line in zip(("pre", "post"), lines):  # the jobs told apart by what they sweep, in order
        assert f"[placement={placement}]: completed: step 30, val loss " in line, line
    assert "2 of 2 job(s) finished" in result.stdout
    assert sorted(s["status"] for s in summaries(tmp_path / "sweep").values()) == ["completed", "completed"]
    assert "sacct" not in result.stdout + result.stderr  # no accounting needed, no warning on every poll
    print(f"2-job sweep through SLURM: {time.time() - start:.1f} s")


def test_a_failed_job_is_reported_and_the_sweep_goes_on(corpus: Path, tmp_path: Path) -> None:
    # n_head=3 does not divide d_model=32: that run is refused at its start, the other one trains
    result = run_sweep(corpus, tmp_path / "cache", tmp_path / "sweep", "model.n_head=2,3")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    ok, bad = job_lines(result.stdout)
    assert "[model.n_head=2]: completed: step 30" in ok, ok
    assert "[model.n_head=3]: failed: no summary.json" in bad and "n_head=3" in bad.split("log ends:")[-1], bad
    assert "1 of 2 job(s) finished, 1 failed" in result.stdout


def test_a_request_the_partition_cannot_meet_is_refused_naming_the_key(corpus: Path, tmp_path: Path) -> None:
    result = run_sweep(corpus, tmp_path / "cache", tmp_path / "sweep", "hydra.launcher.cpus_per_task=4096",
                       timeout=120)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    refusal = [line for line in result.stderr.splitlines() if line.startswith("train.py: hydra/launcher=slurm")]
    assert len(refusal) == 1 and "hydra.launcher.cpus_per_task=4096" in refusal[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr and not summaries(tmp_path / "sweep")


def test_sigusr1_saves_requeues_and_resumes_to_the_uninterrupted_curve(corpus: Path, tmp_path: Path,
                                                                       reference: Path) -> None:
    sweep = tmp_path / "sweep"
    proc, log = start_sweep(corpus, tmp_path / "cache", sweep, *LONG)
    # the job's steps get the signal, as with SLURM's time-limit warning (--batch would signal the batch shell)
    job, rc, out = interrupt_midway(proc, log, sweep, "--signal=USR1", at_step=300)
    assert rc == 0, out[-4000:]
    assert show_job(job).get("Restarts") == "1", show_job(job)
    (summary,) = summaries(sweep).values()
    attempts = [(a["status"], a["from_step"], a["to_step"]) for a in summary["attempts"]]
    assert summary["status"] == "completed" and len(attempts) == 2 and attempts[0][0] == "interrupted", attempts
    assert "completed: step 1500" in job_lines(out)[0]
    (run,) = sweep.glob("*/metrics.csv")
    assert figures(run.parent) == figures(reference)  # row for row, perf/ aside


def test_a_plain_scancel_is_reported_and_the_same_command_continues(corpus: Path, tmp_path: Path,
                                                                   reference: Path) -> None:
    sweep = tmp_path / "sweep"
    proc, log = start_sweep(corpus, tmp_path / "cache", sweep, *LONG)
    # a lost job (no result) is reported, not waited on forever
    job, rc, out = interrupt_midway(proc, log, sweep, at_step=300, timeout=200)
    assert rc == 1, out[-4000:]
    (line,) = job_lines(out)
    assert "interrupted: step" in line and "SLURM state CANCELLED, no result" in line and "run the same" in line, line
    result = run_sweep(corpus, tmp_path / "cache", sweep, *LONG)  # the same command again
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "completed: step 1500" in job_lines(result.stdout)[0]
    (summary,) = summaries(sweep).values()
    assert [a["status"] for a in summary["attempts"]] == ["interrupted", "completed"]
    (run,) = sweep.glob("*/metrics.csv")
    assert figures(run.parent) == figures(reference)


def test_cpu_ddp_runs_two_tasks(corpus: Path, tmp_path: Path) -> None:
    result = run_sweep(corpus, tmp_path / "cache", tmp_path / "sweep", "trainer=ddp", "trainer.accelerator=cpu",
                       "trainer.devices=2", "trainer.precision=32-true")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (summary,) = summaries(tmp_path / "sweep").values()
    assert summary["status"] == "completed" and summary["world_size"] == 2 and summary["steps"] == 30
    submitit = tmp_path / "sweep" / ".submitit"
    assert "#SBATCH --ntasks-per-node=2" in next(submitit.glob("*/*_submission.sh")).read_text()
    assert "gpus" not in next(submitit.glob("*/*_submission.sh")).read_text()  # a CPU run asks for no GPU
    assert len(list(submitit.glob("*/*_log.err"))) == 2  # srun started one task per rank: SLURM gave the ranks


def test_sigusr1_while_the_job_starts_up_requeues_it(corpus: Path, tmp_path: Path) -> None:
    """The warning before the first step (here while the job imports torch): no checkpoint yet, but a requeue, and
    the requeued job trains the run; before lmlab.run.early_signals, SIGUSR1's default killed the job there."""
    sweep = tmp_path / "sweep"
    proc, log = start_sweep(corpus, tmp_path / "cache", sweep)
    try:
        job = submitted_job(log)
        out = sweep / ".submitit" / job / f"{job}_0_log.out"
        wait_until(lambda: out.exists() and "Loading pickle" in out.read_text(), 120, f"the job's start in {out}")
        time.sleep(1.0)  # past the launcher's catch_early, well before train() (torch and Lightning take seconds)
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
        rc = proc.wait(timeout=300)
    finally:
        proc.kill()
    assert rc == 0, log.read_text()[-4000:]
    assert f"before the run started: nothing to save; requeued SLURM job {job}" in out.read_text(), out.read_text()
    assert show_job(job).get("Restarts") == "1"
    (summary,) = summaries(sweep).values()
    assert summary["status"] == "completed" and [a["status"] for a in summary["attempts"]] == ["completed"]


@pytest.mark.slow
def test_the_real_time_limit_warning_requeues_until_the_run_completes(corpus: Path, tmp_path: Path) -> None:
    """SLURM's own warning (`--signal=USR1@45` before a 2-minute limit), not one sent by hand: each allocation saves
    and requeues, and the run ends completed over several attempts, one per allocation. SLURM checks time limits
    every 30 s and sends the warning up to that much early: before a 1-minute limit it came 0-15 s into an
    allocation, at times before training started, and such an allocation (requeued with nothing to save) is a restart
    without an attempt. The run must outlast one allocation on any machine: 10,000 steps once took two allocations
    on a loaded CI machine (~100 steps/s) and one on an idle one (~250 steps/s: 47 s, no requeue); 20,000 steps take
    at least 80 s of training at the faster rate, past any allocation's warning (45-75 s in)."""
    sweep = tmp_path / "sweep"
    result = run_sweep(corpus, tmp_path / "cache", sweep, "trainer.max_steps=20000", "trainer.val_check_interval=2000",
                       "trainer.log_every_n_steps=200", "monitor.every_n_steps=2000", "monitor.attn_every_n_steps=4000",
                       "hydra.launcher.timeout_min=2", "hydra.launcher.signal_delay_s=45", timeout=1500)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    (summary,) = summaries(sweep).values()
    statuses = [a["status"] for a in summary["attempts"]]
    assert summary["status"] == "completed" and summary["steps"] == 20000
    assert len(statuses) >= 2 and set(statuses[:-1]) == {"interrupted"}, statuses
    job = re.search(r"slurm: submitted 1 job\(s\): (\S+?);", result.stdout).group(1)
    assert int(show_job(job)["Restarts"]) == len(statuses) - 1
