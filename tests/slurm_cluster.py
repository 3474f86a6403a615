"""The `slurm` fixture and helpers for the tests on a real SLURM scheduler (tests/e2e/slurm/).

The tests do not start a cluster: `.ci/run` does (`bash scripts/local_slurm.sh start`, a one-node cluster on the
test machine) and stops it afterwards; where no controller answers `scontrol ping` they are skipped, saying so.
Every submitting command runs with a timeout: a scheduler that never starts a job must fail the test, not hang CI.
The jobs import the checkout's lmlab: sbatch exports the submitter's environment, PYTHONPATH included."""

from __future__ import annotations

import csv
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.runs import ROOT, tiny


def cluster_answers() -> str | None:
    """None when a SLURM controller answers, else why not."""
    if not shutil.which("scontrol") or not shutil.which("sbatch"):
        return "no SLURM client here (scontrol, sbatch): `sudo bash scripts/local_slurm.sh start` installs one"
    try:
        out = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "`scontrol ping` did not answer in 10 s"
    if "is UP" not in out.stdout:
        return f"no SLURM controller answers `scontrol ping` ({(out.stdout + out.stderr).strip()[:200]}): " \
               f"`sudo bash scripts/local_slurm.sh start` starts a local one"
    return None


@pytest.fixture
def slurm() -> None:
    """Skips the test with the reason when no SLURM cluster answers; a node that SLURM itself lost is brought back
    first (`nodes_lost`, `bring_back`), so that one daemon's crash does not fail every test after it."""
    why = cluster_answers()
    if why:
        pytest.skip(why)
    if nodes_lost():
        bring_back()


def nodes_lost() -> list[str]:
    """The nodes whose slurmd no longer answers (`sinfo`: down or not responding). Debian's slurmd 22.05.8 aborts now
    and then while it launches two job steps at once: glibc's "malloc(): unaligned tcache chunk detected" inside its
    own hostlist code (nodelist_find), a core file in /var/log/slurm; seen once in CI. Not lmlab's doing."""
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], capture_output=True, text=True, timeout=30).stdout
    lost = {n for n, state in (line.split()[:2] for line in out.splitlines() if line.strip())
            if state.startswith(("down", "idle*", "mixed*", "allocated*", "drain", "fail"))}
    # the controller notices a dead slurmd only after SlurmdTimeout; the script's records say it at once
    for record, node in (("slurmd", os.uname().nodename.split(".")[0]), ("slurmd-n2", "n2")):
        pid_file = Path("/run/lmlab-slurm") / f"{record}.pid"
        if pid_file.is_file() and not Path(f"/proc/{pid_file.read_text().split()[0]}").exists():
            lost.add(node)
    return sorted(lost)


def bring_back() -> None:
    """Restart what the project's script started and has died (`start` is idempotent: it only starts a recorded
    daemon that is gone, and resumes its node); the daemons stay recorded, so `.ci/run` stops them as before."""
    two = "n2" in subprocess.run(["sinfo", "-h", "-N", "-o", "%N"], capture_output=True, text=True,
                                 timeout=30).stdout.split()
    environ = {**os.environ, **({"LOCAL_SLURM_TWO_NODES": "1"} if two else {})}
    for node in nodes_lost():  # a slurmd restarted below registers again; its node must be resumed
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=lmlab-tests-restart"],
                       capture_output=True, timeout=30)
    res = subprocess.run(["bash", str(ROOT / "scripts" / "local_slurm.sh"), "start"], env=environ,
                         capture_output=True, text=True, timeout=300)
    for node in nodes_lost():
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], capture_output=True, timeout=30)
    wait_until(lambda: not nodes_lost(), 60, f"the nodes back after local_slurm.sh start ({res.stderr[-500:]})")


def env(**extra: str) -> dict[str, str]:
    """The submitter's environment, which sbatch passes on to the jobs: the checkout's lmlab, one thread."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", **extra}


def sweep_command(corpus: Path, cache: Path, sweep_dir: Path, *extra: str) -> list[str]:
    """`python train.py -m <tiny run> <extra> hydra/launcher=slurm` on CPU, with the defaults of the CPU launcher."""
    return [sys.executable, str(ROOT / "train.py"), "-m", *tiny(corpus, cache, "trainer.accelerator=cpu", *extra),
            "hydra/launcher=slurm", f"hydra.sweep.dir={sweep_dir}"]


def run_sweep(corpus: Path, cache: Path, sweep_dir: Path, *extra: str, timeout: float = 300,
              environ: dict[str, str] | None = None):
    """The submitting command to its end. When a node's slurmd died under it (`nodes_lost`: SLURM's own crash, not
    a result of the command), the cluster is brought back and the same command is run once more, saying so."""
    def once():
        return subprocess.run(sweep_command(corpus, cache, sweep_dir, *extra), cwd=sweep_dir.parent,
                              env=env(**(environ or {})), capture_output=True, text=True, timeout=timeout)

    result = once()
    if lost := nodes_lost():
        print(f"slurmd of {lost} died during the sweep (SLURM's own crash): brought back, the command run again")
        bring_back()
        result = once()
    return result


def start_sweep(corpus: Path, cache: Path, sweep_dir: Path, *extra: str,
                environ: dict[str, str] | None = None) -> tuple[subprocess.Popen, Path]:
    """The submitting command in the background; its output goes to `<sweep_dir>.out`."""
    log = sweep_dir.with_suffix(".out")
    with open(log, "w") as out:
        proc = subprocess.Popen(sweep_command(corpus, cache, sweep_dir, *extra), cwd=sweep_dir.parent,
                                env=env(**(environ or {})),
                                stdout=out, stderr=subprocess.STDOUT, text=True)
    return proc, log


def wait_until(condition, timeout: float, what: str, poll: float = 0.5):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def submitted_job(log: Path, timeout: float = 120) -> str:
    """The SLURM job id the submitter printed (`slurm: submitted 1 job(s): 12_0; ...`)."""
    def job():
        found = re.search(r"slurm: submitted \d+ job\(s\): (\S+?)[;,]", log.read_text())
        return found and found.group(1)

    return wait_until(job, timeout, f"the submission in {log}")


def last_step(run_dir_glob: str, sweep_dir: Path) -> int:
    """The last step metrics.csv has a row for, in the job's run directory (0 before there is one)."""
    files = list(sweep_dir.glob(run_dir_glob))
    if not files:
        return 0
    with open(files[0], newline="") as f:
        steps = [int(r["step"]) for r in csv.DictReader(f) if r.get("step")]
    return max(steps, default=0)


def interrupt_midway(proc: subprocess.Popen, log: Path, sweep_dir: Path, *scancel: str, at_step: int,
                     within: float = 180, timeout: float = 400) -> tuple[str, int, str]:
    """Once the sweep's job has logged `at_step`, `scancel [scancel ...] <job>`; then wait for the submitting command:
    (the job id, its exit code, its output). The submitter is killed whatever happens."""
    try:
        job = submitted_job(log)
        wait_until(lambda: last_step("*/metrics.csv", sweep_dir) >= at_step, within, f"step {at_step} in metrics.csv")
        subprocess.run(["scancel", *scancel, job], check=True, timeout=30)
        rc = proc.wait(timeout=timeout)
    finally:
        proc.kill()
    return job, rc, log.read_text()


def show_job(job: str) -> dict[str, str]:
    """`scontrol show job`'s fields (JobState, Restarts, ...); the controller keeps an ended job for MinJobAge."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def two_nodes() -> dict[str, str]:
    """The environment a job over partition `two` needs (scripts/local_slurm.sh with LOCAL_SLURM_TWO_NODES=1): gloo on
    the veth both nodes share, the first node's address as MASTER_ADDR (n2 is not in /etc/hosts); skips otherwise."""
    out = subprocess.run(["sinfo", "-h", "-N", "-p", "two", "-o", "%N %o %T"], capture_output=True, text=True,
                         timeout=30).stdout.split("\n")
    nodes = sorted(line.split() for line in out if line.strip())
    if len(nodes) < 2 or not all(n[2] in ("idle", "mixed") for n in nodes):
        pytest.skip(f"no partition `two` with 2 idle nodes (sinfo: {nodes}): LOCAL_SLURM_TWO_NODES=1 "
                    f"scripts/local_slurm.sh start makes one")
    return {"GLOO_SOCKET_IFNAME": "lmlabv", "MASTER_ADDR": nodes[0][1]}
