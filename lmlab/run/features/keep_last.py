"""checkpoint.keep_last=k: besides best.ckpt and last.ckpt, step_<N>.ckpt of the last k validations, what
`eval.py merge=last:k` averages (lmlab.run.keep_last; a resume still reads last.ckpt)."""

from __future__ import annotations

from omegaconf import OmegaConf

from lmlab.registry import PositiveInt, check_value
from lmlab.run.features import Feature, Started


def _keep(cfg):
    return OmegaConf.select(cfg, "checkpoint.keep_last", default=None)


def _check(cfg, model) -> None:
    check_value("checkpoint.keep_last", _keep(cfg), PositiveInt | None)


def _start(cfg, at) -> Started:
    from lmlab.run.keep_last import KeepLast

    return Started([KeepLast(at.run.path, _keep(cfg))])


FEATURE = Feature("keep_last", on=lambda cfg: _keep(cfg) is not None, check=_check, start=_start, place="checkpoint")
