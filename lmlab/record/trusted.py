"""What lmlab builds from a config's `_target_`: classes of Lightning or lmlab, of the kinds a Trainer takes — never
whatever callable a config names.

The trainer and the loggers are the only configs lmlab hands to `hydra.utils.instantiate` (STYLE §13: third-party
classes whose keys pass through). Hydra builds whatever `_target_` names, recursively, and its block-list stops
`os.system`, not `torch.save` or lmlab's own atomic writer. So every `_target_` in those configs is checked first,
before any module it names is imported: the module under `lightning.` or `lmlab.`, the object a class, the class a
subclass of what that place takes (the root a Trainer or a Logger; inside it a strategy, plugin, callback, logger,
accelerator or profiler). Anything else is refused naming the key and what is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

TRUSTED_MODULES = ("lightning.pytorch.", "lightning.fabric.", "lmlab.")
REFUSED_KEYS = ("_partial_", "_args_")  # a partial is a callable, not an object; positional args hide what they set

# The kinds of object a Trainer and its loggers are built as, by name: the root a Trainer or a Logger; inside it what
# a Trainer (or a logger) takes as an object built from its config.
KINDS = {"Trainer": "lightning.pytorch.Trainer", "Logger": "lightning.pytorch.loggers.Logger",
         "Strategy": "lightning.pytorch.strategies.Strategy", "Precision": "lightning.pytorch.plugins.Precision",
         "CheckpointIO": "lightning.fabric.plugins.CheckpointIO", "Callback": "lightning.pytorch.Callback",
         "ClusterEnvironment": "lightning.fabric.plugins.ClusterEnvironment",
         "Accelerator": "lightning.pytorch.accelerators.Accelerator",
         "Profiler": "lightning.pytorch.profilers.Profiler"}
NESTED = tuple(kind for kind in KINDS if kind != "Trainer")
# The targets lmlab's own configs name (lmlab/conf), with their kind, so that a run's config is checked without
# importing Lightning (eval.py, generate.py: seconds of each start); any other target is imported and its class
# checked. tests/unit/record/test_saved_state.py imports each of these and checks its kind.
SHIPPED = {"lightning.pytorch.Trainer": "Trainer", "lightning.pytorch.loggers.WandbLogger": "Logger",
           "lmlab.record.tensorboard.TensorBoardLogger": "Logger", "lmlab.run.distributed.FSDP2Strategy": "Strategy"}


def check_targets(node: Any, key: str, root: type) -> None:
    """Raise ValueError naming the key for a `_target_` in `node` (the config at `key`) that lmlab would not build:
    `root` is the kind the node itself must build (lightning's Trainer, Logger)."""
    _check(node, key, (root.__name__,), None)


def _check(node: Any, key: str, kinds: tuple[str, ...], nested: tuple[str, ...] | None) -> None:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, DictConfig | ListConfig):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, Sequence) and not isinstance(node, str):
        for i, item in enumerate(node):
            _check(item, f"{key}[{i}]", kinds, nested)
        return
    if not isinstance(node, Mapping):
        return
    if "_target_" in node:
        _check_class(node["_target_"], f"{key}._target_", kinds)
        for special in REFUSED_KEYS:
            if special in node:
                raise ValueError(f"{key}.{special}: lmlab builds objects from a config, with keyword arguments only "
                                 f"(refused: {', '.join(REFUSED_KEYS)})")
        kinds = nested = nested or NESTED
    elif nested is None:  # a plain mapping at the root: whatever it holds is what the root would take
        kinds = nested = NESTED
    for k, v in node.items():
        if k != "_target_":
            _check(v, f"{key}.{k}", kinds, nested)


def _check_class(target: Any, key: str, kinds: tuple[str, ...]) -> None:
    accepted = f"a class of {' or '.join(m.rstrip('.') for m in TRUSTED_MODULES)} that is a {', '.join(kinds)}"
    if not isinstance(target, str) or not target.startswith(TRUSTED_MODULES):
        raise ValueError(f"{key}={target!r} is not something lmlab builds: {accepted}")  # nothing imported
    if SHIPPED.get(target) in kinds:  # one of lmlab's own, of a kind this place takes: nothing imported
        return
    from hydra._internal.utils import _locate  # get_class's lookup, without its error log

    try:
        cls = _locate(target)
    except ImportError as err:
        lines = [s.strip() for s in str(err).splitlines() if s.strip()] or ["not found"]
        found = next((s for s in lines if "Error(" in s), lines[-1])  # Hydra's message: the line naming the miss
        raise ValueError(f"{key}={target!r} is not something lmlab builds ({found}): {accepted}") from None
    if not isinstance(cls, type) or not issubclass(cls, tuple(_locate(KINDS[kind]) for kind in kinds)):
        what = cls.__name__ if isinstance(cls, type) else f"not a class but a {type(cls).__name__}"
        raise ValueError(f"{key}={target!r} is not something lmlab builds ({what}): {accepted}")


def check_config_targets(config: Any, resolve: bool = True) -> None:
    """`check_targets` on a config's trainer (a Trainer) and each of its loggers (a Logger): every place lmlab
    builds from a config, so a composed config and one read back from a run are checked by the same rule. `resolve`:
    on their values as they will be built (interpolations resolved: a resolver can make a `_target_`, and its name
    can itself be an interpolation); a recorded config is checked as it is written (resolve=False)."""
    if resolve:
        config = {"trainer": resolved(config.get("trainer"), "trainer"),
                  "logger": resolved(config.get("logger"), "logger")}
    if config.get("trainer") is not None:
        _check(config["trainer"], "trainer", ("Trainer",), None)
    loggers = config.get("logger")
    for name, spec in (loggers.items() if isinstance(loggers, Mapping) else ()):
        if spec is not None:
            _check(spec, f"logger.{name}", ("Logger",), None)


def resolved(node: Any, key: str) -> Any:
    """`node` (a config's trainer or logger) as plain data with every interpolation resolved; one that cannot be
    resolved is refused naming the key."""
    from omegaconf import DictConfig, ListConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(node, DictConfig | ListConfig):
        return node
    try:
        data = OmegaConf.to_container(node, resolve=True)
    except OmegaConfBaseException as err:
        raise ValueError(f"{key}: {' '.join(str(err).split())}") from None
    if where := _interpolation_in(data, key):  # an escaped `\${` resolves to one, which instantiate would resolve
        raise ValueError(f"{where}: a value that resolves to an interpolation is not something lmlab builds")
    return data


def _interpolation_in(node: Any, key: str) -> str | None:
    if isinstance(node, str):
        return key if "${" in node else None
    if isinstance(node, Mapping):
        return next((w for k, v in node.items() if (w := _interpolation_in(v, f"{key}.{k}") or (
            f"{key}.{k}" if "${" in str(k) else None))), None)
    if isinstance(node, Sequence):
        return next((w for i, v in enumerate(node) if (w := _interpolation_in(v, f"{key}[{i}]"))), None)
    return None


def build(node: Any, key: str, root: type, **kwargs: Any) -> Any:
    """`hydra.utils.instantiate` of `node` resolved (`resolved`), once every `_target_` in it has passed
    `check_targets`: what is checked is what is built, nothing resolves after the check."""
    from hydra.utils import instantiate

    data = resolved(node, key)
    check_targets(data, key, root)
    return instantiate(data, **kwargs)
