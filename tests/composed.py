"""`lmlab.compose`, once per config in each pytest worker: a config composed again (the same overrides, the same config
name) is a copy of the first (`copy.deepcopy`: its own object, flags and all, ~4 ms) instead of Hydra reading and
merging its ~40 YAMLs again (~150 ms; ~350 ms for a late speedrun row). Composing is more than half of `make test`'s
CPU time (190 of ~330 s, measured: 1,082 compositions on two workers), and 180 of those compositions repeat one the
same worker made before (the same optimizer in each of its file's tests).

Sound because a composition reads nothing but the overrides and the YAMLs, which no test writes: interpolations
(`${oc.env:...}`) stay unresolved in the copy as in the original. A composition that fails is not kept: the next call
composes again and raises again. tests/conftest.py installs it (LMLAB_TEST_COMPOSE_CACHE=0: every call composes)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Sequence

from omegaconf import DictConfig


def once_per_config(compose: Callable[..., DictConfig]) -> Callable[..., DictConfig]:
    """`compose`, with each distinct (overrides, config_name) composed once and copied after."""
    first: dict[tuple[str, tuple[str, ...]], DictConfig] = {}

    @functools.wraps(compose)
    def composed(overrides: Sequence[str] | None = None, config_name: str = "train") -> DictConfig:
        key = (config_name, tuple(overrides or ()))
        try:
            hash(key)
        except TypeError:  # not strings: Hydra's own error, each time
            return compose(overrides, config_name)
        if key not in first:
            first[key] = compose(list(key[1]), config_name)
        return copy.deepcopy(first[key])

    composed.composed = first  # what it holds: tests/unit/project/test_composed.py
    return composed
