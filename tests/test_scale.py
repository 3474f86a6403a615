"""Scaling out: the SLURM launcher's sbatch script (dry run: submitit's own script, nothing submitted), the launch
layout checks (SLURM, torchrun), and the presets at real scale (parameter counts on the meta device)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lmlab import build_model, compose
from lmlab.run.training import check_config
from tests.runs import ROOT, cli

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


def dry_run(tmp_path: Path, *overrides: str) -> str:
    result = cli(str(ROOT / "train.py"), "-m", "hydra/launcher=slurm_dry_run", *overrides, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def sbatch_flags(script: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(.*))?$", script, flags=re.M))


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_slurm_dry_run_of_a_sweep_is_one_job_array(tmp_path: Path) -> None:
    out = dry_run(tmp_path, "trainer.devices=2", "seed=1,2,3", "hydra.launcher.signal_delay_s=300")
    flags = sbatch_flags(out)
    assert flags["array"] == "0-2%3" and flags["ntasks-per-node"] == "2" and flags["nodes"] == "1"
    assert flags["signal"] == "USR1@300"
    assert "array task 2: trainer.devices=2 seed=3" in out


@pytest.mark.e2e
@pytest.mark.parametrize(("overrides", "key"), [
    (["trainer=ddp"], "trainer.devices='auto'"),  # ddp's default: auto is not a number of tasks
    (["trainer.devices=2", "trainer.num_nodes=0"], "trainer.num_nodes=0"),
])
def test_slurm_launcher_refuses_a_layout_it_cannot_submit(tmp_path: Path, overrides: list[str], key: str) -> None:
    result = cli(str(ROOT / "train.py"), "-m", "hydra/launcher=slurm_dry_run", *overrides, cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    assert key in result.stderr and "hydra/launcher=slurm" in result.stderr, result.stderr[-2000:]
    assert "#SBATCH" not in result.stdout


SLURM_JOB = {"SLURM_NTASKS": "16", "SLURM_JOB_NAME": "lmlab", "SLURM_JOB_ID": "7", "SLURM_PROCID": "0",
             "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "n[1-2]", "SLURM_NTASKS_PER_NODE": "8",
             "SLURM_NNODES": "2"}
TORCHRUN = {"TORCHELASTIC_RUN_ID": "x", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
            "GROUP_RANK": "0", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}


@pytest.mark.parametrize(("env", "overrides", "names"), [
    (SLURM_JOB, ["trainer.devices=auto", "trainer.num_nodes=2"], ["trainer.devices='auto'", "SLURM", "devices=8"]),
    (SLURM_JOB, ["trainer.devices=4", "trainer.num_nodes=2"], ["trainer.devices=4", "--ntasks-per-node=8"]),
    (SLURM_JOB, ["trainer.devices=8"], ["trainer.num_nodes=1", "--nodes=2"]),
    (TORCHRUN, ["trainer.devices=auto"], ["trainer.devices='auto'", "torchrun", "devices=2"]),
    (TORCHRUN, ["trainer.devices=2"], ["trainer.num_nodes=1", "--nnodes=2"]),
])
def test_launch_layout_is_checked_before_training(monkeypatch, env, overrides, names) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError) as err:
        check_config(compose(overrides))
    for name in names:
        assert name in str(err.value), (name, str(err.value))


@pytest.mark.parametrize("env", [SLURM_JOB, TORCHRUN])
def test_a_matching_launch_layout_passes(monkeypatch, env) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    per_node, nodes = (8, 2) if env is SLURM_JOB else (2, 2)
    check_config(compose([f"trainer.devices={per_node}", f"trainer.num_nodes={nodes}"]))


def gpt_params(V: int, d: int, L: int, T: int) -> int:
    """GPT-2 by formula: tied embeddings, learned positions, biases everywhere, LayerNorm with bias, MLP 4d."""
    per_layer = 2 * (2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return V * d + T * d + L * per_layer + 2 * d


def llama_params(V: int, d: int, L: int, n_head: int, n_kv: int, hidden: int) -> int:
    """Llama by formula: tied embeddings, RMSNorm (weight only), no biases, GQA, SwiGLU."""
    kv = d // n_head * n_kv
    return V * d + L * (2 * d + d * d * 2 + 2 * d * kv + 3 * d * hidden) + d


def meta_params(overrides: list[str], vocab: int) -> int:
    cfg = compose(overrides)
    check_config(cfg)
    with torch.device("meta"):
        return build_model(cfg, vocab_size=vocab).num_params()


def test_gpt2_124m_preset_has_gpt2s_parameter_count() -> None:
    assert gpt_params(50257, 768, 12, 1024) == 124_439_808  # GPT-2 small's published count (HF GPT2LMHeadModel)
    cfg = compose(["model=gpt2_124m", "data=bpe50k"])
    assert (cfg.norm.name, cfg.placement.name, cfg.ffn.name, cfg.activation.name, cfg.position.name) == (
        "layer", "pre", "mlp", "gelu", "learned")
    assert (cfg.data.tokenizer, cfg.data.vocab_size, cfg.data.name) == ("bpe", 50304, "shakespeare")
    n = meta_params(["model=gpt2_124m", "data=bpe50k"], cfg.data.vocab_size)
    assert n == gpt_params(50304, 768, 12, 1024) == 124_475_904
    assert meta_params(["model=gpt2_124m"], 50257) == 124_439_808


def test_llama_1b_preset_has_llama_3_2_1bs_parameter_count() -> None:
    assert llama_params(128256, 2048, 16, 32, 8, 8192) == 1_235_814_400  # Llama-3.2-1B's published count
    overrides = ["model=llama_1b", "norm=rms", "ffn=swiglu", "ffn.hidden_mult=6", "position=rope",
                 "position.theta=500000", "attention=gqa"]
    assert meta_params(overrides, 128256) == 1_235_814_400


@pytest.mark.parametrize("model", ["gpt2_124m", "llama_1b"])
def test_presets_build_and_run_at_a_small_depth(model: str) -> None:
    """The preset as it is (width, heads, context) runs forward; 1 layer keeps it to a second on CPU."""
    model_ = build_model(compose([f"model={model}", "model.n_layer=1"]), vocab_size=64)
    assert model_(torch.randint(0, 64, (1, 16))).shape == (1, 16, 64)


@pytest.mark.e2e
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
