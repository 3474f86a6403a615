"""hydra/launcher=slurm's schema: submitit's SLURM queue config and lmlab's own key, `wait` (registered with Hydra's
ConfigStore as `lmlab_submitit_slurm`, which conf/hydra/launcher/slurm.yaml extends). No `from __future__ import
annotations` here: Hydra's plugin scan imports this module outside sys.modules, where a dataclass with string
annotations cannot be made."""

from dataclasses import dataclass

from hydra.core.config_store import ConfigStore

try:  # the slurm extra (hydra-submitit-launcher)
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
except ImportError:  # pragma: no cover
    SlurmQueueConf = None

if SlurmQueueConf is not None:
    @dataclass
    class LmlabSlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.lmlab_slurm.launcher.LmlabSlurmLauncher"
        # false: submit every job (one array) and return at once; `lmlab sweep status DIR` follows them
        wait: bool = True

    ConfigStore.instance().store(group="hydra/launcher", name="lmlab_submitit_slurm", node=LmlabSlurmConf,
                                 provider="lmlab")
