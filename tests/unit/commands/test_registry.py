"""Registries vs conf/: every YAML stem == its `name:` == a registry key (and vice versa), every YAML key is
accepted by the option's signature, and bad names / keys fail with a message naming the group and the choices."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.activation import ACTIVATIONS
from lmlab.model.attention import ATTENTIONS
from lmlab.model.block import BLOCKS
from lmlab.model.ffn import FFNS
from lmlab.model.init import INITS
from lmlab.model.norm import NORMS
from lmlab.model.param import PARAMS
from lmlab.model.placement import PLACEMENTS
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.optim import OPTIMIZERS, SCHEDULES
from lmlab.registry import build, option_params
from tests.runs import ROOT

CONF = ROOT / "conf"
GROUPS = {
    "block": BLOCKS,
    "norm": NORMS,
    "placement": PLACEMENTS,
    "activation": ACTIVATIONS,
    "ffn": FFNS,
    "position": POSITIONS,
    "attention": ATTENTIONS,
    "init": INITS,
    "param": PARAMS,
    "optim": OPTIMIZERS,
    "schedule": SCHEDULES,
}


def _alias_of(path: Path) -> str | None:
    """The option a YAML only renames (`defaults: [<option>, _self_]` and nothing else: attention=differential is
    attention=diff, the record's name the option's own), else None."""
    raw = OmegaConf.to_container(OmegaConf.load(path))
    defaults = raw.get("defaults", [])
    if set(raw) == {"defaults"} and len(defaults) == 2 and defaults[1] == "_self_" and isinstance(defaults[0], str):
        return defaults[0]
    return None


ALIASES = {(group, path.stem): alias for group in sorted(GROUPS) for path in sorted((CONF / group).glob("*.yaml"))
           if (alias := _alias_of(path))}
YAMLS = [(group, path) for group in sorted(GROUPS) for path in sorted((CONF / group).glob("*.yaml"))
         if (group, path.stem) not in ALIASES]


def _load(path: Path) -> dict:
    """The option of `path` (conf/<group>/<option>.yaml) as a run composes it, the group's shared keys included."""
    return OmegaConf.to_container(compose([f"{path.parent.name}={path.stem}"])[path.parent.name], resolve=True)


def _option_spec(group: str, spec: dict) -> dict:
    """The part of a group's YAML that goes to the option itself (the rest is read by GPTConfig / the loop)."""
    if group == "ffn":  # hidden_mult / multiple_of are turned into the hidden size by GPTConfig
        return resolve(GPTConfig(vocab_size=50, d_model=32, n_head=4, ffn=spec)).ffn_spec
    if group == "optim":  # weight_decay / grad_clip are read by param_groups / the training loop
        from lmlab.run.lit import optimizer_spec

        return optimizer_spec(spec)
    return spec


def _keyword_only(fn) -> list[str]:
    """An option's keys: its keyword-only parameters and, through `**shared`, its base's (lmlab.registry)."""
    from lmlab.registry import option_types

    return sorted(option_types(fn))


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_yaml_stems_are_the_registry_keys(group: str) -> None:
    stems = {p.stem for p in (CONF / group).glob("*.yaml") if (group, p.stem) not in ALIASES}
    assert stems == set(GROUPS[group]), f"conf/{group}/ and the {group} registry disagree"


@pytest.mark.parametrize(("group", "stem"), sorted(ALIASES), ids=[f"{g}/{s}" for g, s in sorted(ALIASES)])
def test_an_alias_yaml_composes_to_the_option_it_names(group: str, stem: str) -> None:
    """An alias is a second name, not a second option: it names a registry key, and composes to that option exactly."""
    target = ALIASES[(group, stem)]
    assert target in GROUPS[group] and stem not in GROUPS[group]
    assert _load(CONF / group / f"{stem}.yaml") == _load(CONF / group / f"{target}.yaml")


def test_the_alias_walk_finds_attention_differential() -> None:
    assert ALIASES == {("attention", "differential"): "diff"}  # a new alias is added here on purpose, not by accident


@pytest.mark.parametrize(("group", "path"), YAMLS, ids=[f"{g}/{p.stem}" for g, p in YAMLS])
def test_yaml_name_is_its_stem_and_keys_are_accepted(group: str, path: Path) -> None:
    spec = _load(path)
    assert spec["name"] == path.stem
    name, params = option_params(group, GROUPS[group], _option_spec(group, spec))
    assert name == path.stem
    assert params == {k: v for k, v in _option_spec(group, spec).items() if k != "name"}
    assert set(params) <= set(_keyword_only(GROUPS[group][name]))


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_unknown_name_lists_the_choices(group: str) -> None:
    with pytest.raises(ValueError) as err:
        option_params(group, GROUPS[group], {"name": "no_such_option"})
    msg = str(err.value)
    assert f"{group}='no_such_option'" in msg
    assert str(sorted(GROUPS[group])) in msg


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_missing_name_lists_the_choices(group: str) -> None:
    with pytest.raises(ValueError) as err:
        option_params(group, GROUPS[group], {})
    assert group in str(err.value) and str(sorted(GROUPS[group])) in str(err.value)


@pytest.mark.parametrize(("group", "name"), [(g, n) for g in sorted(GROUPS) for n in sorted(GROUPS[g])])
def test_unknown_key_names_the_option_and_its_keys(group: str, name: str) -> None:
    with pytest.raises(ValueError) as err:
        option_params(group, GROUPS[group], {"name": name, "bogus_key": 1})
    msg = str(err.value)
    assert f"{group}={name!r}" in msg
    assert "bogus_key" in msg
    assert str(_keyword_only(GROUPS[group][name])) in msg


def test_option_params_does_not_mutate_the_spec() -> None:
    spec = {"name": "rms", "eps": 0.5}
    assert option_params("norm", NORMS, spec) == ("rms", {"eps": 0.5})
    assert spec == {"name": "rms", "eps": 0.5}


def test_build_passes_positional_args_and_spec_keys() -> None:
    norm = build("norm", NORMS, {"name": "rms", "eps": 0.25, "affine": False}, 12)
    assert isinstance(norm, NORMS["rms"])
    assert norm.dim == 12 and norm.eps == 0.25 and norm.weight is None
