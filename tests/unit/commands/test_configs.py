"""Every YAML of every group composes through `compose()` and builds; bad input fails before training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from lmlab import CONF_DIR, build_model, compose
from lmlab.config import arch_config
from lmlab.run.training import check_config

GROUPS = sorted(p.name for p in CONF_DIR.iterdir()  # experiment, hparams_search, recipe: _global_ files (own tests)
                if p.is_dir() and not p.name.endswith("_base")  # *_base: the keys a group's options share
                and p.name not in ("hydra", "experiment", "hparams_search", "recipe", "speedrun_step"))
OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]
EXPERIMENTS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
RECIPES = sorted(p.stem for p in (CONF_DIR / "recipe").glob("*.yaml"))


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=[f"{g}={o}" for g, o in OPTIONS])
def test_every_option_composes_and_builds(group: str, option: str, monkeypatch) -> None:
    if group == "trainer":  # gpu|ddp|fsdp: the no-GPU refusal is tested in test_validation.py; here the rest must pass
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    overrides = [f"{group}={option}"]
    if group == "rope_scaling":
        overrides.append("position=rope")
    required = {"text_files": "data.paths=[x.txt]", "hf": "data.dataset=x",
                "mixture": "data.sources={x: {paths: [x.txt], weight: 1}}",
                "classify": "head.labels=[a,b]"}  # (the data's, data=labelled; check_config takes any two)
    if group in ("data", "head") and option in required:
        overrides.append(required[option])
    cfg = compose(overrides)
    assert cfg[group] is not None
    check_config(cfg)  # architecture on the meta device, optimizer, schedule
    if group not in ("model",):  # the large sizes are only checked on meta: building them here costs seconds
        model = build_model(cfg, vocab_size=40)
        out = model(torch.randint(0, 40, (1, 8)))
        assert out.shape == ((1, 2) if option == "classify" else (1, 8, 40))  # a classifier: its labels' logits


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


STEPS = sorted(p.stem for p in (CONF_DIR / "speedrun_step").glob("*.yaml"))


def test_the_speedrun_ladders_rows_are_cumulative() -> None:
    """Each row of experiment=speedrun_ladder is the row before plus its record's changes: the sweep names every row,
    every row checks, and what a row sets (beyond what its successor changes on purpose) stays set after it."""
    params = OmegaConf.load(CONF_DIR / "experiment" / "speedrun_ladder.yaml").hydra.sweeper.params
    assert str(params.speedrun_step).split(",") == STEPS
    rows = []
    for step in STEPS:
        cfg = compose(["experiment=speedrun_ladder", f"speedrun_step={step}"])
        check_config(cfg)
        rows.append(cfg)
    first, last = rows[0], rows[-1]

    def row(name: str):
        return rows[STEPS.index(name)]

    assert (first.position.name, first.norm.name, first.optim.name, first.model.bias) == ("learned", "layer", "adamw",
                                                                                         True)
    assert (last.position.name, last.norm.name, last.optim.name, last.activation.name) == ("rope", "rms", "muon",
                                                                                          "relu2")
    assert last.attention.qk_norm and last.model.embed_norm
    assert (last.model.logit_softcap, last.model.logit_softcap_width, last.model.logit_softcap_offset) == (11.5, 15, 5)
    assert last.attention.xsa == "gated" and last.attention.key_offset and last.position.rotary_pct == 0.5
    assert list(last.residual) == ["scaled", "x0", "unet", "value_embed", "smear", "backout", "bigram_hash"]
    assert last.residual.smear.init == 0.0  # the record's λ: the standard model at step 0
    assert last.init.zero_proj and last.init.mimetic_vo == 0.05  # records 5 and 64
    assert (last.residual.unet.gate, last.residual.unet.pairs, last.residual.scaled.stream_init) == (
        "sigmoid", [[1, 4]], 1.1)  # records 32 and 45
    assert last.optim.groups[0] == {"match": "h.*.mlp.c_fc.weight", "lr_mult": 2.0}  # record 42
    assert last.ffn.skip_layers == [0] and last.mixer.pattern[3] == "none"  # records 30 and 17
    assert last.attention.paired_heads == [0, 2, 4]  # record 58
    assert row("43_ve_shared").attention.window_schedule.end == 128  # record 13
    assert row("54_bare_attention").data.batch_schedule[-1] == [0.66, 24]  # record 46
    assert last.data.seq_schedule[0] == [0, 64]  # record 72
    assert (last.optim.split, last.optim.ns_coefficients, last.optim.adam_every, last.optim.normuon,
            last.optim.cautious_wd) == ("head_pairs", "polar_express", 2, True, True)  # records 4/80, 38, 39, 41, 43
    assert last.schedule.name == "wsd" and last.attention.gate_channels == 12  # records 19, 28
    assert last.head.name == "mtp_logits" and row("36_ve_untied").residual.value_embed.layers == [0, 1, 4, 5]  # 53, 63
    assert last.residual.value_embed.gate_channels == last.residual.unet.gate_channels == 12  # record 55
    untie, untie_steps = row("40_normuon_beta2").model, row("40_normuon_beta2").trainer.max_steps
    assert untie.tie_embeddings and untie.untie_at_step == round(0.6667 * untie_steps)  # record 53
    assert last.model.tie_embeddings and last.model.untie_at_step is None  # records 51 and 87: tied throughout
    assert (last.attention.window_block, row("43_ve_shared").attention.window_schedule.round) == (16, "nearest")  # 16
    assert row("39_ve_layout").residual.value_embed.layers == [1, 2, 4, 5]  # record 70
    assert last.residual.value_embed.layers == [[1, 5], [2, 4]]  # record 15's mirrored sharing
    assert (last.optim.normuon_beta2, row("56_doc_mask").schedule.decay_frac) == (0.9, 0.45)  # records 78, 26
    assert row("44_long_short").attention.pattern == [128, 64, 64, 64, 64, 128]  # record 20: long first and last
    assert (row("56_doc_mask").attention.temperature, last.optim.eps) == (0.737, 1e-10)  # record 20's 0.12 and eps
    assert last.attention.window_schedule.stages == [[0, 32], [0.3333, 64], [0.6667, 96]]  # record 29
    assert row("46_eval_final").attention.eval_window == [96, 48, 48, 48, 48, 128]  # record 33: the last layer's
    assert last.attention.eval_window == [128, 48, 48, 48, 48, 128]  # record 35: every long layer's
    groups = {g["match"] if isinstance(g["match"], str) else g["match"][0]: g for g in last.optim.groups}
    assert groups["h.*.mlp.c_proj.weight"].lr_mult == 4.0 and groups["h.*.attn.c_attn.weight"].lr_mult == 2.0  # 48
    assert groups["wte.weight"].weight_decay == 0.1 and groups["wte.weight"].betas == [0.5, 0.95]  # records 50, 57
    assert groups["residual.options.smear.gate"].lr_mult == 0.01  # record 52
    assert groups["residual.options.scaled.stream"].betas == [0.9, 0.99]  # record 52
    assert groups["h.*.attn.gate.weight"].role == "other"  # record 56
    assert (last.residual.bigram_hash.signs, last.residual.bigram_hash.dim) == (8192, 32)  # record 83
    assert last.residual.scaled.unscaled_mixer == [0, 1, 2]  # record 74
    assert last.trainer.max_steps == 508 and last.data.batch_schedule[0] == [0, 6]  # record 21
    assert last.attention.doc_mask and last.data.eod == "<|endoftext|>"  # record 12
    assert last.position.window_yarn and last.schedule.decay_frac == 0.5  # record 31
    assert [r.optim.name for r in rows].index("muon") == STEPS.index("02_muon")  # each row adds one record
    same = [b for a, b in zip(STEPS, STEPS[1:]) if rows[STEPS.index(a)] == row(b)]
    assert same == [], f"rows that change nothing: {same}"
    speedrun = compose(["recipe=speedrun"])
    row = rows[STEPS.index("08_softcap15")]
    for key in ("position.name", "norm.name", "norm.affine", "activation.name", "optim.name", "attention.qk_norm",
                "model.bias", "model.tie_embeddings", "model.logit_softcap", "model.embed_norm"):
        assert OmegaConf.select(speedrun, key) == OmegaConf.select(row, key), key  # recipe=speedrun is row 08
    assert list(speedrun.residual) == list(row.residual)


def sweep_points(experiment: str) -> list[list[str]]:
    """Every job of an experiment's sweep (hydra.sweeper.params, read from its file) as a list of overrides."""
    import itertools

    from omegaconf import OmegaConf

    params = OmegaConf.load(CONF_DIR / "experiment" / f"{experiment}.yaml").hydra.sweeper.params
    axes = [[f"{k}={v}" for v in str(values).split(",")] for k, values in params.items()]
    return [list(point) for point in itertools.product(*axes)]


SWEPT = [(e, point) for e in ("gau_depth", "gau_length", "deep_scale", "optim_compare") for point in sweep_points(e)]


@pytest.mark.parametrize(("experiment", "point"), SWEPT, ids=[f"{e}:{','.join(p)}" for e, p in SWEPT])
def test_every_swept_value_composes(experiment: str, point: list[str]) -> None:
    cfg = compose([f"experiment={experiment}", *point])
    check_config(cfg)  # the architecture on the meta device, optimizer, schedule
    for override in point:  # the swept value is the one the job gets, not shadowed by the experiment's own setting
        key, value = override.split("=")
        got = cfg[key].name if key in GROUPS else OmegaConf.select(cfg, key)
        assert str(got) == value, (override, got)
    assert cfg.schedule.warmup_steps == (0 if experiment in ("gau_depth", "deep_scale") else 100)


# (norm, norm.affine, placement, ffn, position, attention, block, block score, model.bias, model.tie_embeddings)
RECIPE_AXES = {
    "gpt2": ("layer", True, "pre", "mlp", "learned", "mha", "transformer", None, True, True),
    "llama": ("rms", True, "pre", "swiglu", "rope", "gqa", "transformer", None, False, False),
    "roformer_v2": ("rms", False, "post", "mlp", "rope", "mha", "transformer", None, False, True),
    "gau_alpha": ("rms", False, "post", "mlp", "rope", "mha", "gau", "softmax_plus", False, True),
    "speedrun": ("rms", False, "pre", "mlp", "rope", "mha", "transformer", None, False, False),
}


def _axes(cfg) -> tuple:
    return (cfg.norm.name, cfg.norm.affine, cfg.placement.name, cfg.ffn.name, cfg.position.name, cfg.attention.name,
            cfg.block.name, cfg.block.get("score"), cfg.model.bias, cfg.model.tie_embeddings)


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_sets_its_axes_and_builds(recipe: str) -> None:
    """One override sets several axes; the model builds (on meta) with every one of them."""
    assert RECIPES == sorted(RECIPE_AXES)
    cfg = compose([f"recipe={recipe}"])
    assert _axes(cfg) == RECIPE_AXES[recipe]
    check_config(cfg)
    with torch.device("meta"):
        model = build_model(cfg, vocab_size=40)
    assert (model.lm_head.weight is model.wte.weight) == cfg.model.tie_embeddings
    assert all(m.bias is None for m in model.modules() if isinstance(m, torch.nn.Linear)) != cfg.model.bias
    if recipe == "gau_alpha":
        assert model.cfg.activation["name"] == "silu"
    if recipe == "speedrun":  # the stream the speedrun's: scalars, embedding shortcut, skips, value embeddings
        assert list(model.cfg.residual) == ["scaled", "x0", "unet", "value_embed"]
        assert model.cfg.activation["name"] == "relu2" and model.cfg.attention["qk_norm"]
        assert model.cfg.logit_softcap == 15.0 and model.ln_e is not None
    if not cfg.norm.affine:  # no gain on any norm
        assert not [n for n, _ in model.named_parameters() if ".ln_" in n or n.startswith("ln_f")]


@pytest.mark.parametrize(("overrides", "axis", "value"), [
    (["recipe=llama", "norm=layer"], "norm", "layer"),
    (["norm=layer", "recipe=llama"], "norm", "layer"),  # the command line wins wherever the recipe is given
    (["recipe=llama", "position=alibi"], "position", "alibi"),
    (["recipe=gpt2", "ffn=swiglu"], "ffn", "swiglu"),
    (["recipe=roformer_v2", "placement=pre"], "placement", "pre"),
    (["recipe=gau_alpha", "block.score=relu2"], "block", "relu2"),
    (["recipe=roformer_v2", "norm.affine=true"], "norm", True),
    (["recipe=llama", "model.tie_embeddings=true"], "model", True),
])
def test_a_recipe_stays_overridable_axis_by_axis(overrides: list[str], axis: str, value) -> None:
    cfg = compose(overrides)
    got = {"norm": cfg.norm.name if isinstance(value, str) else cfg.norm.affine, "position": cfg.position.name,
           "ffn": cfg.ffn.name, "placement": cfg.placement.name, "block": cfg.block.get("score"),
           "model": cfg.model.tie_embeddings}[axis]
    assert got == value
    check_config(cfg)
    rest = compose([o for o in overrides if o.startswith("recipe=")])  # the other axes keep the recipe's choice
    changed = {"norm": 0, "position": 4, "ffn": 3, "placement": 2, "block": 7, "model": 9}[axis]
    if isinstance(value, bool) and axis == "norm":
        changed = 1
    kept = [a for j, a in enumerate(_axes(cfg)) if j != changed]
    assert kept == [a for j, a in enumerate(_axes(rest)) if j != changed]


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
    from lmlab.run.training import train

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
    assert launch["_target_"].startswith(("hydra_plugins.hydra_submitit_launcher", "hydra_plugins.lmlab_slurm"))
    if launcher == "slurm":  # one task per device: Lightning's SLURMEnvironment reads the ranks from it
        assert launch["tasks_per_node"] == 4 and launch["gpus_per_node"] == 4 and launch["max_num_timeout"] == 3


def test_a_whole_run_of_warmup_is_warned_of_only_when_the_warmup_was_chosen() -> None:
    """`trainer.max_steps=50` on a config with 100 warmup steps is a smoke run: no warning. A warmup the command sets
    at or past the steps is a mistake worth a line (and a library call, whose overrides are unknown, is told too)."""
    import warnings

    cfg = compose(["schedule.warmup_steps=100", "trainer.max_steps=50"])
    for overrides, warned in ((["trainer.max_steps=50"], False), (["schedule.warmup_steps=100"], True), (None, True)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            check_config(cfg, overrides)
        assert any("the whole run is warmup" in str(w.message) for w in caught) == warned, overrides
