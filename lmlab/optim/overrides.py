"""`optim.groups`: settings per tensor over the optimizer's groups, for the parameters whose names match — a
learning-rate and a weight-decay multiplier, a weight decay of their own, Adam's betas, and under an optimizer that
splits by role (Muon) which half steps them. The GPT-2 speedrun keeps such a table, one row per tensor (`lr_mul`,
`wd_mul`, `adam_betas`, `optim: adam | muon`: records 42, 48, 52, 55, 56, 57); here each entry is

    {match: <glob or list of globs over model.named_parameters()>, lr_mult: 1.0, wd_mult: 1.0,
     weight_decay: null, betas: null, role: null}

e.g. `optim.groups=[{match: 'h.*.mlp.c_fc.weight', lr_mult: 2.0}]` (record 42's up-projection at twice the lr),
`{match: 'residual.*', betas: [0.9, 0.99]}` (record 52's smoother scalars), `{match: '*.attn.gate.weight', role:
other}` (record 56: the gates to AdamW). A parameter takes the first entry that matches it. lr_mult multiplies the
group's lr before the schedule reads it (as µP's per-role rule does); wd_mult the decay the group had, weight_decay
replaces it (embeddings and gains included: the speedrun decays its embedding tables from record 50 on); betas are
Adam's (AdamW's groups; Muon's keep its momentum); role `hidden` sends a matrix to Muon, `other` to AdamW.
"""

from __future__ import annotations

import fnmatch
from typing import Literal

from torch import nn

from lmlab.optim import Betas
from lmlab.registry import NonNegativeFloat, PositiveFloat, check_values

KEYS = {"match": str | list[str], "lr_mult": PositiveFloat, "wd_mult": NonNegativeFloat,
        "weight_decay": NonNegativeFloat | None, "betas": Betas | None, "role": Literal["hidden", "other"] | None}
DEFAULTS = {"lr_mult": 1.0, "wd_mult": 1.0, "weight_decay": None, "betas": None, "role": None}


def entries(spec: list | None) -> list[dict]:
    """The entries, checked (keys, types, a `match`), with their defaults filled in."""
    out = []
    for i, entry in enumerate(spec or []):
        if not isinstance(entry, dict) or "match" not in entry:
            raise ValueError(f"optim.groups[{i}]={entry!r} must be a mapping with a `match` (a glob over the "
                             f"parameter names, e.g. 'h.*.mlp.c_fc.weight') and any of {sorted(DEFAULTS)}")
        if unknown := sorted(entry.keys() - KEYS.keys()):
            raise ValueError(f"optim.groups[{i}] has {unknown}; an entry takes {sorted(KEYS)}")
        check_values(f"optim.groups[{i}].", entry, KEYS)
        globs = [entry["match"]] if isinstance(entry["match"], str) else list(entry["match"])
        out.append({**DEFAULTS, **entry, "match": globs})
    return out


def _which(name: str, spec: list[dict]) -> int | None:
    return next((i for i, e in enumerate(spec) if any(fnmatch.fnmatchcase(name, g) for g in e["match"])), None)


def check(optim: dict, roles: bool, model: nn.Module) -> None:
    """Before training: every entry matches a parameter of `model` (the meta device's), a `role`
    only under an optimizer that splits by role, `hidden` only for matrices."""
    spec = entries(optim.get("groups"))
    if not spec:
        return
    named = list(model.named_parameters())
    for i, entry in enumerate(spec):
        hits = [(n, p) for n, p in named if _which(n, spec) == i]
        if not hits:
            some = ", ".join(n for n, _ in named[:6])
            raise ValueError(f"optim.groups[{i}].match={entry['match']} matches no parameter not matched before it "
                             f"(the first entry that matches a name takes it); the names read like {some}, ...")
        if entry["role"] is not None and not roles:
            raise ValueError(f"optim.groups[{i}].role={entry['role']} chooses Muon's or AdamW's half of an optimizer "
                             f"that splits tensors by role (optim=muon); optim={optim.get('name')} has one update: "
                             f"drop the role")
        if entry["role"] == "hidden" and (flat := [n for n, p in hits if p.dim() != 2]):
            raise ValueError(f"optim.groups[{i}].role=hidden sends tensors to Muon, which orthogonalises matrices: "
                             f"{flat[:3]} are not 2-D; use role=other (AdamW) for them")


def split(model: nn.Module, groups: list[dict], spec: list | None) -> list[dict]:
    """`groups` (lmlab.optim.param_groups') with each entry's parameters in a group of their own: the group's
    settings, its weight decay × wd_mult (or the entry's weight_decay), and `lr_mult`, `betas`, `role` as set."""
    spec = entries(spec)
    if not spec:
        return groups
    index = {id(p): _which(n, spec) for n, p in model.named_parameters()}
    laid = any("layouts" in g for g in groups)  # Muon's split reads each hidden matrix's row blocks
    out = []
    for g in groups:
        layouts = dict(zip(map(id, g["params"]), g.get("layouts", [None] * len(g["params"]))))
        for i in (None, *range(len(spec))):
            params = [p for p in g["params"] if index.get(id(p)) == i]
            if not params:
                continue
            group = {**g, "params": params}
            if i is not None:
                entry = spec[i]
                group["weight_decay"] = (entry["weight_decay"] if entry["weight_decay"] is not None
                                         else g["weight_decay"] * entry["wd_mult"])
                group["lr_mult"] = entry["lr_mult"]
                if entry["betas"] is not None:
                    group["betas"] = tuple(entry["betas"])
                if entry["role"] is not None:
                    group["role"] = entry["role"]
            group.pop("layouts", None)
            if laid and group.get("role") == "hidden":
                group["layouts"] = [layouts[id(p)] for p in params]
            out.append(group)
    return out
