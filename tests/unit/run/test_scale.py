"""Scaling out: the SLURM launcher's sbatch script (dry run: submitit's own script, nothing submitted), the launch
layout checks (SLURM, torchrun), and the presets at real scale (parameter counts on the meta device)."""

from __future__ import annotations

import pytest
import torch

from lmlab import build_model, compose
from lmlab.run.training import check_config

pytest.importorskip("hydra_plugins.hydra_submitit_launcher")


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
