"""Scaling out: the SLURM launcher's sbatch script (dry run: submitit's own script, nothing submitted), the launch
layout checks (SLURM, torchrun), and the presets at real scale (parameter counts on the meta device)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.runs import ROOT, cli


def dry_run(tmp_path: Path, *overrides: str) -> str:
    result = cli(str(ROOT / "train.py"), "-m", "hydra/launcher=slurm_dry_run", *overrides, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def sbatch_flags(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, flags=re.M))


def test_slurm_dry_run_prints_the_sbatch_script_for_4_nodes_of_8_gpus(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "trainer=ddp", "trainer.num_nodes=4", "trainer.devices=8", "model=gpt2_124m",
                  "hydra.launcher.timeout_min=600", "hydra.launcher.partition=gpu")
    flags = sbatch_flags(out)
    assert flags["nodes"] == "4" and flags["ntasks-per-node"] == "8"  # one task per GPU: SLURMEnvironment's ranks
    assert flags.get("gpus-per-node") == "8" or flags.get("gres") == "gpu:8"
    assert flags["time"] == "600" and flags["partition"] == "gpu"
    assert flags["signal"] == "USR1@120"  # lmlab's save-and-requeue signal, not submitit's USR2
    assert "array" not in flags  # one job
    srun = [line for line in out.splitlines() if line.startswith("srun ")]
    assert len(srun) == 1  # every task runs the job: submitit unpickles Hydra's job and runs train.py's main
    assert re.fullmatch(rf"srun --unbuffered .* -u -m submitit\.core\._submit {tmp_path}/multirun/\S+/\.submitit/%j",
                        srun[0]), srun[0]
    assert "trainer=ddp trainer.num_nodes=4 trainer.devices=8 model=gpt2_124m" in out
    assert not list(tmp_path.rglob(".submitit")) and not list(tmp_path.rglob("*.pkl"))  # nothing left, nothing ran
    assert not list(tmp_path.rglob("summary.json"))


def test_slurm_dry_run_of_a_sweep_is_one_job_array(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "trainer.devices=2", "seed=1,2,3", "hydra.launcher.signal_delay_s=300")
    flags = sbatch_flags(out)
    assert flags["array"] == "0-2%3" and flags["ntasks-per-node"] == "2" and flags["nodes"] == "1"
    assert flags["signal"] == "USR1@300"
    assert "array task 2: trainer.devices=2 seed=3" in out


@pytest.mark.parametrize(("overrides", "key"), [
    (["trainer=ddp"], "trainer.devices='auto'"),  # ddp's default: auto is not a number of tasks
    (["trainer.devices=2", "trainer.num_nodes=0"], "trainer.num_nodes=0"),
])
def test_slurm_launcher_refuses_a_layout_it_cannot_submit(tmp_path: Path, overrides: list[str], key: str) -> None:
    result = cli(str(ROOT / "train.py"), "-m", "hydra/launcher=slurm_dry_run", *overrides, cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert key in result.stderr and "hydra/launcher=slurm" in result.stderr, result.stderr[-2000:]
    assert "#SBATCH" not in result.stdout


def test_torchrun_gives_the_losses_of_lightnings_own_ddp_launcher(corpus: Path, tmp_path: Path) -> None:
    """torchrun starts the ranks (Lightning's TorchElasticEnvironment reads RANK / LOCAL_RANK / WORLD_SIZE);
    the same run through Lightning's own launcher (trainer.devices=2) logs the same per-step losses."""
    from tests.runs import metric, tiny

    common = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "data.batch"))]
    common += ["trainer.max_steps=3", "trainer.val_check_interval=3", "data.batch_size=4", "trainer.accelerator=cpu",
               "trainer.devices=2", "trainer.strategy=ddp"]
    lit, trun = tmp_path / "lit", tmp_path / "torchrun"
    res = cli(str(ROOT / "train.py"), *common, f"hydra.run.dir={lit}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    res = cli("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",  # = torchrun
              str(ROOT / "train.py"), *common, f"hydra.run.dir={trun}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("train/loss", "val/loss"):
        a, b = metric(lit, name), metric(trun, name)
        assert a.keys() == b.keys() and len(a) >= 1, name
        assert all(b[step] == pytest.approx(a[step], rel=1e-6) for step in a), (name, a, b)
