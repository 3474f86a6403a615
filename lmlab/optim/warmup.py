"""A short run is never all warmup: the schedule's default warmup (conf/schedule/<name>.yaml: 100 steps for cosine)
is capped at a fifth of the run (`WARMUP_CAP`) when the command did not choose it, and the run says so in one line.

Without the cap every run of up to 100 steps (the README's 50- and 60-step examples, a 40-step sweep) ended before the
learning rate reached optim.lr: a quick comparison compared models that never left warmup. A warmup the command sets
(`schedule.warmup_steps=...`) or an experiment sets (any value other than the option's default) is the user's and is
kept; so is a resumed run's own, so that continuing a capped 60-step run to 1200 does not restart its warmup.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from lmlab.cli import override_key
from lmlab.registry import CONF_DIR

WARMUP_CAP = 0.2  # of trainer.max_steps


def default_warmup(schedule: str) -> int | None:
    """The warmup_steps of conf/schedule/<schedule>.yaml (None: an option without one there)."""
    path = CONF_DIR / "schedule" / f"{schedule}.yaml"
    return OmegaConf.load(path).get("warmup_steps") if path.is_file() else None


def fit_warmup(cfg: DictConfig, overrides: list[str] | None, saved: dict[str, Any] | None = None) -> str | None:
    """Cap the effective config's schedule.warmup_steps at WARMUP_CAP x trainer.max_steps when it is the schedule's
    default and `overrides` (the command's; None: unknown, as chosen) do not set it; a resume (`saved`, its
    checkpoint) keeps the warmup its run had. Writes into `cfg` (the plan's own copy); returns the line to print, None
    when nothing changed."""
    warmup, steps = cfg.schedule.get("warmup_steps"), int(cfg.trainer.max_steps)
    if overrides is None or any(override_key(o) == "schedule.warmup_steps" for o in overrides):
        return None
    if warmup is None or warmup != default_warmup(cfg.schedule.get("name", "")):
        return None  # an experiment's (or a config's) own warmup
    if saved is not None:
        own = ((saved.get("hyper_parameters") or {}).get("schedule") or {}).get("warmup_steps")
        if own is not None and own != warmup:
            cfg.schedule.warmup_steps = own
        return None
    cap = int(WARMUP_CAP * steps)
    if warmup <= cap:
        return None
    cfg.schedule.warmup_steps = cap
    return (f"schedule.warmup_steps={cap}: the default {warmup} capped at {WARMUP_CAP:.0%} of trainer.max_steps={steps}"
            f", so the lr reaches optim.lr at step {cap}; set schedule.warmup_steps to choose")
