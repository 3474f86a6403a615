"""downstream.tasks=[...]: lm-eval tasks scored at validations, logged beside the val loss as
downstream/<task>/<metric> (lmlab.run.downstream), their last values in summary.json. Loaded as the run starts, so a
task that cannot load refuses the start; its keys are checked without importing lm-eval
(lmlab.run.checks.check_downstream)."""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

from lmlab.run.checks import check_downstream
from lmlab.run.features import Feature, Started


def _block(cfg) -> dict[str, Any]:
    node = OmegaConf.select(cfg, "downstream", default=None)
    return OmegaConf.to_container(node, resolve=True) if node is not None else {}


def _check(cfg, model) -> None:
    if OmegaConf.select(cfg, "downstream", default=None) is None:
        return
    block = _block(cfg)
    check_downstream(block)
    from lmlab.model.head import HEADS

    head = model.cfg.head["name"]
    if block.get("tasks") and not HEADS[head].predicts_next:
        raise ValueError(f"downstream.tasks scores the next-token log-likelihoods of continuations; "
                         f"head={head} does not predict the next token: use downstream.tasks=[]")


def _start(cfg, at) -> Started:
    """The Downstream callback, scoring at every `every_n_vals`-th validation's step; a resume carries the previous
    summary's last values."""
    from lmlab.run.downstream import Downstream, carried

    block = _block(cfg)
    tasks = block["tasks"]
    every = int(block.get("every_n_vals") or 1) * int(cfg.trainer.get("val_check_interval") or 1)
    callback = Downstream([tasks] if isinstance(tasks, str) else list(tasks), at.data.tokenizer, every=every,
                          limit=block.get("limit"), last=carried(at.previous, at.resume_step))
    return Started([callback], figures=callback.figures)


FEATURE = Feature("downstream", on=lambda cfg: bool(_block(cfg).get("tasks")), check=_check, start=_start, order=30)
