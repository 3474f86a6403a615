"""optim.qk_clip=τ: the optimizer option needs its clip in the loop, every step after the optimizer's
(lmlab.optim.qk_clip; its callback lmlab.run.qk_clip), and refuses the models and strategies it cannot clip."""

from __future__ import annotations

from omegaconf import OmegaConf

from lmlab.run.features import Feature, Started


def _on(cfg) -> bool:
    return cfg.optim.get("qk_clip") is not None


def _check(cfg, model) -> None:
    from lmlab.optim.qk_clip import check_qk_clip
    from lmlab.run.checks import strategy_name

    check_qk_clip(OmegaConf.to_container(cfg.optim), model, model.cfg.attention["name"], strategy_name(cfg))


def _start(cfg, at) -> Started:
    from lmlab.run.qk_clip import QKClipCallback

    return Started([QKClipCallback(float(cfg.optim.qk_clip))])


FEATURE = Feature("qk_clip", on=_on, check=_check, start=_start, order=20)
