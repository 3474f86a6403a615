"""TensorBoard as lmlab writes it (logger=tensorboard): the losses on its first screen, the keys a run sets first in
its HParams table.

TensorBoard's Scalars and Time Series dashboards order their groups (a tag up to its first `/`) by name, so `act/`,
`attn/` and `grad/` came before `train/` and `val/`, and a "loss" filter showed the one-point `summary/` charts first.
The losses are also written under `0_loss/` (`0_loss/train`, `0_loss/val`), which sorts before every other group;
their own tags stay, as metrics.csv and W&B name them. The HParams table lists first the hyperparameters that
`differ` and then the rest by name; Lightning marks none, so the whole config came alphabetically and the swept
column was off-screen. Here the keys the run's overrides set (a sweep's swept keys among them) are marked.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger

from lmlab import names
from lmlab.cli import override_key

FIRST = "0_loss"
LOSSES_FIRST = {names.TRAIN_LOSS: f"{FIRST}/train", names.VAL_LOSS: f"{FIRST}/val"}


def set_keys(overrides: list[str], params: dict[str, Any]) -> list[str]:
    """The flattened hyperparameter names (`trainer/max_steps`, `norm/name` for `norm=rms`) the overrides set."""
    out = []
    for o in overrides:
        key = override_key(o).replace(".", "/")
        out += [k for k in (key, f"{key}/name") if k in params]
    return out


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's TensorBoardLogger with the losses first and the set keys marked (see the module docstring)."""

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        first = {LOSSES_FIRST[k]: v for k, v in metrics.items() if k in LOSSES_FIRST}
        super().log_metrics({**first, **metrics}, step)

    def log_hyperparams(self, params: Any, metrics: dict[str, Any] | None = None, step: int | None = None) -> None:
        from lightning.fabric.loggers.tensorboard import _TENSORBOARD_AVAILABLE
        from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
        if _TENSORBOARD_AVAILABLE:  # the writer Lightning writes with, and TensorBoard's message (it has `differs`)
            from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData
            from torch.utils.tensorboard.summary import hparams
        else:  # tensorboardX's older message has no `differs`: the set keys are only put first
            from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData
            from tensorboardX.summary import hparams

        super().log_hyperparams(params, metrics={}, step=step)  # Lightning keeps them (hparams.yaml), writes nothing
        params = _convert_params(params)
        flat = self._sanitize_params(_flatten_dict(params))
        metrics = metrics if metrics is not None else {"hp_metric": -1} if self._default_hp_metric else {}
        if not metrics:
            return
        self.log_metrics(metrics, step)
        exp, ssi, sei = hparams(flat, metrics)
        marked = set(set_keys(list(params.get("overrides") or []), flat))
        data = HParamsPluginData.FromString(exp.value[0].metadata.plugin_data.content)
        infos = sorted(data.experiment.hparam_infos, key=lambda h: h.name not in marked)  # the set keys first, too
        for info in infos:
            if hasattr(info, "differs"):
                info.differs = info.name in marked
        data.experiment.ClearField("hparam_infos")
        data.experiment.hparam_infos.extend(infos)
        exp.value[0].metadata.plugin_data.content = data.SerializeToString()
        writer = self.experiment._get_file_writer()
        for summary in (exp, ssi, sei):
            writer.add_summary(summary, step)
