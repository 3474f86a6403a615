"""precision.fp8=[kinds]: the Linear layers it names become torchao's Float8Linear (lmlab.run.fp8), before the first
forward (LitGPT's torch.compile traces then) and before trainer=fsdp2 shards the model (LitGPT.configure_model);
summary.json's `fp8` lists them."""

from __future__ import annotations

from omegaconf import OmegaConf

from lmlab.run import fp8
from lmlab.run.features import Feature, Started


def _start(cfg, at) -> Started:
    layers = fp8.apply(at.model, cfg)
    return Started(figures=lambda: {"fp8": layers})


FEATURE = Feature("fp8", on=lambda cfg: bool(OmegaConf.select(cfg, "precision.fp8", default=None)),
                  check=lambda cfg, model: fp8.check(cfg), start=_start)
