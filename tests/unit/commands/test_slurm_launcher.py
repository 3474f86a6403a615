"""hydra/launcher=slurm's requests, composed (no cluster): GPUs only for a GPU run, a CPU run that fits a small node,
an accelerator the launcher cannot map refused naming the key; the report's line for each way a job can end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


def launcher(*overrides: str) -> dict:
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from lmlab import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("train", overrides=["hydra/launcher=slurm", *overrides], return_hydra_config=True)
    return OmegaConf.to_container(cfg.hydra.launcher, resolve=True)


@pytest.mark.parametrize(("overrides", "gpus", "cpus", "mem"), [
    (["trainer.devices=4"], 4, 8, 64),  # accelerator auto: a GPU where the job runs
    (["trainer=ddp", "trainer.devices=8"], 8, 8, 64),
    (["trainer.accelerator=cpu", "trainer.devices=2"], None, 1, 4),  # no --gpus-per-node: sbatch refused it (gres)
    (["trainer.accelerator=cpu", "threads=4"], None, 4, 4),  # the CPUs the run uses
    (["trainer.accelerator=cpu", "hydra.launcher.mem_gb=16", "hydra.launcher.cpus_per_task=2"], None, 2, 16),
])
def test_the_request_follows_the_accelerator(overrides: list[str], gpus, cpus: int, mem: int) -> None:
    launch = launcher(*overrides)
    assert (launch["gpus_per_node"], launch["cpus_per_task"], launch["mem_gb"]) == (gpus, cpus, mem)
    assert launch["_target_"] == "hydra_plugins.lmlab_slurm.launcher.LmlabSlurmLauncher"


def test_an_accelerator_the_launcher_cannot_map_is_refused_naming_the_key() -> None:
    with pytest.raises(Exception, match=r"trainer.accelerator='tpu'.*\['gpu', 'cuda', 'auto', 'cpu'\]"):
        launcher("trainer.accelerator=tpu")


def write_summary(run: Path, **summary) -> Path:
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(summary))
    return run


def test_the_report_line_says_how_each_job_ended(tmp_path: Path) -> None:
    from hydra_plugins.lmlab_slurm.report import line

    log = tmp_path / "job.err"
    log.write_text("Traceback ...\ntrain.py: model.d_model=32 is not divisible by model.n_head=3\n")
    done = write_summary(tmp_path / "a", status="completed", steps=60, final_val_loss=2.89841)
    assert line("4_0", "placement=pre", done, ("success", 2.9), None, log) == (
        f"slurm job 4_0 [placement=pre]: completed: step 60, val loss 2.8984 -> {done}", False)
    cut = write_summary(tmp_path / "b", status="interrupted", steps=117, final_val_loss=None)
    text, failed = line("4_1", "", cut, None, "SLURM state CANCELLED, no result", log)
    assert failed and text.startswith("slurm job 4_1: interrupted: step 117, val loss none")
    assert text.endswith("SLURM state CANCELLED, no result: its checkpoint is kept; run the same command again to "
                         "continue it")
    text, failed = line("4_2", "model.n_head=3", tmp_path / "never", ("success", float("inf")), None, log)
    assert failed and "failed: no summary.json" in text and text.endswith("model.n_head=3"), text
    diverged = write_summary(tmp_path / "c", status="diverged", steps=12, final_val_loss=float("nan"))
    assert line("4_3", "", diverged, ("success", float("inf")), None, log)[1] is False  # a result, not a failure
