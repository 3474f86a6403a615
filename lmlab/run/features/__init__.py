"""Run-time features: what a run does beside the model, the optimizer and the data (the Jacobian norms, QK-clip,
downstream tasks, FP8 matmuls, step checkpoints, spike skipping), each declared in its own file of this package as
`FEATURE = Feature(...)`, gathered like options (lmlab.registry.gather). A new run-time feature is its declaration
here, its code and its test: `lmlab.run.checks.check_config` runs every feature's `check`, `lmlab.run.training` starts
every feature the config turns on and adds its callbacks, in place.

The declarations are light (torch and lmlab's checks at most): check_config reads them before Lightning is imported;
each imports its Lightning callback when it starts."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from omegaconf import DictConfig


@dataclass
class Start:
    """What a feature may read as the run starts: once the plan is made and the model built, before the run directory
    is written (a feature that refuses leaves every file as it was)."""

    run: Any  # the run directory (lmlab.record.rundir.RunDir)
    model: Any  # the model as it will train (LitGPT.model, on its device)
    data: Any  # the data module, set up
    previous: dict[str, Any] | None  # the summary a resume continues (None: a fresh start)
    resume_step: int


@dataclass
class Started:
    """A started feature: its Lightning callbacks, and what it adds to summary.json once the run has ended."""

    callbacks: list = field(default_factory=list)
    figures: Callable[[], dict[str, Any]] = dict


@dataclass(frozen=True)
class Feature:
    """One run-time feature. `on(cfg)`: whether the config turns it on. `check(cfg, model)`: its keys, refused before
    anything is trained (every config, on or off: a bad value of a feature that is off is refused too), with a
    ValueError naming the key and what it accepts; `model` is the start's meta model (lmlab.run.checks). `start(cfg,
    start)`: what it sets up for a run that turns it on. `place`: where its callbacks go among the run's, beside
    ModelCheckpoint (`checkpoint`) or after the data's own (`task`); `order`: its rank there (the order Lightning calls
    them in, which matters where two act on one hook: the Jacobian norms are measured before QK-clip rescales)."""

    name: str
    on: Callable[[DictConfig], bool]
    check: Callable[[DictConfig, Any], None] | None = None
    start: Callable[[DictConfig, Start], Started] | None = None
    place: Literal["checkpoint", "task"] = "task"
    order: int = 0


@functools.cache
def features() -> tuple[Feature, ...]:
    """Every declared feature, in the order their callbacks go (by place, then order)."""
    from lmlab.registry import gather

    found = gather(__name__, __path__, "FEATURE")
    return tuple(sorted(found.values(), key=lambda f: (f.place != "checkpoint", f.order, f.name)))


def check(cfg: DictConfig, model: Any) -> None:
    """Every feature's checks of `cfg` (lmlab.run.checks.check_config)."""
    for feature in features():
        if feature.check is not None:
            feature.check(cfg, model)


def start(cfg: DictConfig, at: Start) -> dict[str, Started]:
    """Start the features `cfg` turns on, by name, in callback order."""
    return {f.name: f.start(cfg, at) for f in features() if f.start is not None and f.on(cfg)}


def callbacks(started: dict[str, Started], place: str) -> list:
    """The callbacks of the `started` features that go in `place` (Feature.place), in order."""
    return [c for f in features() if f.place == place and f.name in started for c in started[f.name].callbacks]
