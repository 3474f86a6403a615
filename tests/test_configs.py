"""Every YAML of every group composes through `compose()` and builds; bad input fails before training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmlab import CONF_DIR, build_model, compose
from lmlab.config import arch_config
from lmlab.training import check_config

GROUPS = sorted(p.name for p in CONF_DIR.iterdir()  # experiment, hparams_search: _global_ files (their own tests)
                if p.is_dir() and p.name not in ("hydra", "experiment", "hparams_search"))
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_builds(group: str, option: str, monkeypatch) -> None:
    if group == "trainer":  # gpu|ddp|fsdp: the no-GPU refusal is tested in test_validation.py; here the rest must pass
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    overrides = [f"{group}={option}"]
    if group == "rope_scaling":
        overrides.append("position=rope")
    if group == "data" and option in ("text_files", "hf"):
        overrides.append("data.paths=[x.txt]" if option == "text_files" else "data.dataset=x")
    cfg = compose(overrides)
    assert cfg[group] is not None
    check_config(cfg)  # architecture on the meta device, optimizer, schedule
    if group not in ("model",):  # the large sizes are only checked on meta: building them here costs seconds
        model = build_model(cfg, vocab_size=40)
        assert model(torch.randint(0, 40, (1, 8))).shape == (1, 8, 40)


@pytest.mark.parametrize("overrides", [["attention.score=relu2"], ["attention.score=softmax_plus"],
                                       ["block=gau", "block.score=relu2", "position=rope"],
                                       ["block=gau", "model=tiny_gau", "position=alibi", "placement=post"]])
def test_scores_and_blocks_compose_and_build(overrides: list[str]) -> None:
    cfg = compose(overrides)
    check_config(cfg)
    model = build_model(cfg, vocab_size=40)
    assert model(torch.randint(0, 40, (1, 8))).shape == (1, 8, 40)
    gcfg = arch_config(cfg, vocab_size=40)
    assert gcfg.to_dict()["block"]["name"] == cfg.block.name


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_every_experiment_composes(experiment: str) -> None:
    cfg = compose([f"experiment={experiment}"])
    check_config(cfg)


def test_compose_matches_cli_defaults() -> None:
    cfg = compose([])
    assert (cfg.norm.name, cfg.placement.name, cfg.ffn.name, cfg.position.name) == ("layer", "pre", "mlp", "learned")
    cfg = compose(["norm=rms", "ffn=swiglu", "position=rope", "norm.eps=1e-5"])
    gcfg = arch_config(cfg, vocab_size=10)
    assert gcfg.norm == {"name": "rms", "eps": 1e-5, "affine": True}
    assert gcfg.ffn_spec == {"name": "swiglu"} and gcfg.position["name"] == "rope"


@pytest.mark.parametrize(("overrides", "names"), [
    (["rope_scaling=yarn"], ["rope_scaling='yarn'", "position=rope"]),
    (["model.d_model=100", "model.n_head=3"], ["model.d_model=100", "model.n_head=3"]),
    (["position=rope", "model.d_model=36", "model.n_head=4"], ["position=rope", "head dim", "= 9 is odd"]),
    (["attention=gqa", "model.n_kv_head=3"], ["model.n_kv_head=3", "model.n_head=4"]),
    (["norm.name=rmsnorm"], ["norm='rmsnorm'", "'rms'", "'layer'"]),
    (["+norm.epsilon=1e-5"], ["norm='layer'", "epsilon"]),
    (["optim.name=adam"], ["optim='adam'", "'adamw'"]),
    (["schedule.warmup_steps=-1"], ["schedule.warmup_steps"]),
    (["trainer.max_steps=0"], ["trainer.max_steps"]),
    (["malloc=jemalloc"], ["malloc='jemalloc'", "'system'", "'keep'"]),
])
def test_bad_config_fails_before_training(overrides: list[str], names: list[str]) -> None:
    with pytest.raises(ValueError) as err:
        check_config(compose(overrides))
    for name in names:
        assert name in str(err.value), (name, str(err.value))


def test_unknown_group_option_is_a_hydra_error_listing_choices() -> None:
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException, match="Available options in 'norm'"):
        compose(["norm=rmsnorm"])


def test_missing_data_path_and_empty_corpus_fail_before_training(tmp_path: Path) -> None:
    from lmlab.training import train

    with pytest.raises(FileNotFoundError, match="data.paths"):
        train(compose(["data=text_files", f"data.paths=[{tmp_path / 'nope.txt'}]", "logger=none"]), tmp_path / "r1")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="data.paths"):
        train(compose(["data=text_files", f"data.paths=[{empty}]", "logger=none"]), tmp_path / "r2")
    assert not (tmp_path / "r1" / "checkpoints").exists()  # nothing was trained


@pytest.mark.parametrize("launcher", ["slurm", "local"])
def test_submitit_launchers_compose(launcher: str) -> None:
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = hydra_compose("train", overrides=[f"hydra/launcher={launcher}", "trainer.devices=4"],
                            return_hydra_config=True)
    launch = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    assert launch["_target_"].startswith("hydra_plugins.hydra_submitit_launcher")
    if launcher == "slurm":  # one task per device: Lightning's SLURMEnvironment reads the ranks from it
        assert launch["tasks_per_node"] == 4 and launch["gpus_per_node"] == 4 and launch["max_num_timeout"] == 3
