"""Multi-node DDP on a real SLURM cluster of two nodes: `trainer.num_nodes=2` through srun, one rank on each node
(scripts/local_slurm.sh with LOCAL_SLURM_TWO_NODES=1: the second slurmd in a network namespace of its own), and a
preemption of that job that resumes to the uninterrupted 2-rank run's metrics.csv. Skipped without such a cluster."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.runs import ROOT, cli, figures, tiny
from tests.slurm_cluster import (  # noqa: F401  (slurm: the fixture)
    interrupt_midway,
    show_job,
    slurm,
    start_sweep,
    two_nodes,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm")]

DDP = ("trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=1", "trainer.precision=32-true",
       "trainer.max_steps=600", "trainer.val_check_interval=100", "trainer.log_every_n_steps=10",
       "monitor.every_n_steps=50", "monitor.attn_every_n_steps=100")


def test_two_nodes_one_rank_each_preempted_resumes_exactly(corpus: Path, tmp_path: Path) -> None:
    environ = two_nodes()
    sweep = tmp_path / "sweep"
    proc, log = start_sweep(corpus, tmp_path / "cache", sweep, *DDP, "trainer.num_nodes=2",
                            "hydra.launcher.partition=two", environ=environ)
    job, rc, out = interrupt_midway(proc, log, sweep, "--signal=USR1", at_step=150, within=240)
    assert rc == 0, out[-4000:]
    assert "completed: step 600" in out and show_job(job).get("Restarts") == "1"
    (summary,) = [json.loads(p.read_text()) for p in sweep.glob("*/summary.json")]
    assert [a["status"] for a in summary["attempts"]] == ["interrupted", "completed"] and summary["world_size"] == 2
    starts = "".join(p.read_text() for p in (sweep / ".submitit").glob("*/*_log.out"))
    hosts = set(re.findall(r"Starting with JobEnvironment\(.*?hostname=(\w+), .*?node=(\d)\(2\)", starts))
    assert {h for h, _ in hosts} == {"n2", "vm"} and {n for _, n in hosts} == {"0", "1"}, hosts  # a rank per node
    # the reference: the same two ranks on one machine, through Lightning's own launcher
    ref = tmp_path / "ref"
    result = cli(str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache", *DDP, "trainer.devices=2"),
                 f"hydra.run.dir={ref}", cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    (run,) = sweep.glob("*/metrics.csv")
    assert figures(run.parent) == figures(ref)
