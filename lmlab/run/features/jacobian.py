"""jacobian.every_n_steps=N: per-block Jacobian norms, jac/norm/layer_XX, every N steps (lmlab.run.jacobian)."""

from __future__ import annotations

from omegaconf import OmegaConf

from lmlab.run.features import Feature, Started


def _on(cfg) -> bool:
    return bool(OmegaConf.select(cfg, "jacobian.every_n_steps", default=0))


def _start(cfg, at) -> Started:
    from lmlab.run.jacobian import JacobianNorms

    return Started([JacobianNorms(cfg.jacobian.every_n_steps, cfg.jacobian.get("probes", 4))])


FEATURE = Feature("jacobian", on=_on, start=_start, order=10)
