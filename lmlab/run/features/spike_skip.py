"""spike_skip.enabled: skip the update of a step whose loss or grad norm spikes (lmlab.run.spikes, in LitGPT's loop:
no callback); its keys are checked here."""

from __future__ import annotations

from omegaconf import OmegaConf

from lmlab.run.features import Feature
from lmlab.run.spikes import check_spike_skip


def _block(cfg) -> dict:
    return OmegaConf.to_container(OmegaConf.select(cfg, "spike_skip", default={}), resolve=True)


FEATURE = Feature("spike_skip", on=lambda cfg: bool(_block(cfg).get("enabled")),
                  check=lambda cfg, model: check_spike_skip(_block(cfg)))
