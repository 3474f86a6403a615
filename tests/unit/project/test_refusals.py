"""Every `group.key=` a refusal names exists: a message that points the user at a key lmlab does not have (the audit
found `residual.tables` for `residual.value_embed.tables`) sends them looking for nothing. The refusals are every
string of every `raise` in lmlab/; the keys, those of every option YAML of every group (under its `@package` when it
has one) and of the base files the options share."""

from __future__ import annotations

import ast
import re

from omegaconf import OmegaConf

from lmlab import CONF_DIR
from tests.runs import ROOT

NAMED = re.compile(r"(?<![\w./${])([a-z_]+(?:\.[a-z_0-9]+)+)=")  # attention.window=..., not a path or ${...}


def config_keys() -> set[str]:
    """Every dotted key some option of some group defines (leaves and the mappings above them)."""
    keys: set[str] = set()

    def walk(node, prefix: str) -> None:
        keys.add(prefix)
        if OmegaConf.is_dict(node):
            for k in node.keys():
                if k != "defaults":
                    walk(node._get_node(k), f"{prefix}.{k}")

    for group in (p for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"):
        for yaml in group.rglob("*.yaml"):
            header = re.match(r"# @package (\S+)", yaml.read_text())
            package = header[1] if header else group.name.removesuffix("_base")
            cfg = OmegaConf.load(yaml)
            if package == "_global_":
                for k in cfg.keys():
                    if k not in ("defaults", "hydra"):
                        walk(cfg._get_node(k), str(k))
            else:
                walk(cfg, package.replace("_here_", group.name))
    for k in OmegaConf.load(CONF_DIR / "train.yaml").keys():
        walk(OmegaConf.load(CONF_DIR / "train.yaml")._get_node(k), str(k))
    return keys


def named_keys() -> dict[str, list[str]]:
    """{key: the files whose refusals name it} for the keys of lmlab's groups (hydra.* is Hydra's)."""
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()} | set(OmegaConf.load(CONF_DIR / "train.yaml").keys())
    named: dict[str, list[str]] = {}
    for path in sorted((ROOT / "lmlab").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Raise) or node.exc is None:
                continue
            for part in ast.walk(node.exc):
                if isinstance(part, ast.Constant) and isinstance(part.value, str):
                    for match in NAMED.finditer(part.value):
                        key = match[1]
                        if key.split(".")[0] in groups and key.split(".")[0] != "hydra":
                            named.setdefault(key, []).append(str(path.relative_to(ROOT)))
    return named


def test_every_key_a_refusal_names_exists() -> None:
    keys, named = config_keys(), named_keys()
    assert len(named) > 50, len(named)  # the walk finds the refusals (63 keys when written)
    assert "residual.value_embed.tables" in named and "attention.window" in named
    missing = {k: files for k, files in named.items() if k not in keys}
    assert missing == {}, missing


def test_the_walk_catches_a_key_that_does_not_exist() -> None:
    assert "residual.tables" not in config_keys() and "residual.value_embed.tables" in config_keys()
