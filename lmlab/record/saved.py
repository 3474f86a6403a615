"""What lmlab reads back from a run or sweep directory is data, never code.

A run directory is something users copy, share and download, and continuing one re-applies its saved overrides
(`.hydra/overrides.yaml`): a line there is as powerful as the command line that wrote it. So each saved override is
checked before anything is composed or built — one `key=value` per line, the key not Hydra's own and not one of
Hydra's instantiation keys (`_target_`, `_partial_`, ...), its value scalars and lists (a mapping only where lmlab's
config has one, and then without those keys), interpolations only of other keys or `oc.env` (no resolver that makes a
config: `oc.decode`, `oc.create`). Anything else is refused naming the file, the line and why. The configs a run
records (`.hydra/config.yaml`, summary.json's `config`) are checked for `_target_`s lmlab would not build
(lmlab.record.trusted), by the same rule as at build time.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

HYDRA_KEYS = re.compile(r"^_[a-z]+_$")  # _target_, _partial_, _args_, _recursive_, _convert_
RESOLVER = re.compile(r"\$\{\s*([\w.\-]+)\s*:")  # ${name: ...}: a resolver call (${a.b} alone is a key reference)
RESOLVERS = ("oc.env",)  # reads an environment variable; builds nothing


class SavedStateRefused(ValueError):
    """A file of a run or sweep directory holds something lmlab will not act on (named: file, line, why)."""


def read_overrides(path: Path, base: Any = None) -> list[str]:
    """The overrides saved in `path` (a YAML list of strings), each checked; `base`, the config the command composed,
    tells where a mapping belongs (None: nowhere)."""
    import yaml

    text = path.read_text(errors="replace")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as err:
        raise SavedStateRefused(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from None
    if root is None:
        return []
    if not isinstance(root, yaml.SequenceNode):
        raise SavedStateRefused(f"{path}:{root.start_mark.line + 1}: a list of key=value overrides is expected, "
                                f"not a {root.tag.rpartition(':')[2]}")
    out = []
    for item in root.value:
        line = item.start_mark.line + 1
        if not isinstance(item, yaml.ScalarNode) or item.tag != "tag:yaml.org,2002:str":
            raise SavedStateRefused(f"{path}:{line}: each saved override is one key=value string, not a "
                                    f"{item.tag.rpartition(':')[2]}")
        reason = refusal(item.value, base)
        if reason:
            raise SavedStateRefused(f"{path}:{line}: {item.value!r} is refused ({reason}); a run directory's saved "
                                    f"overrides are key=value data: remove the line to continue without it, or start over "
                                    f"with resume=false overwrite=true")
        out.append(item.value)
    return out


def refusal(override: str, base: Any = None) -> str | None:
    """Why the saved `override` is not plain data (None: it is)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_override(override)
    except Exception as err:  # noqa: BLE001  (Hydra's grammar error, any kind)
        return f"not an override: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
    if parsed.is_sweep_override():
        return "a sweep of values: a run's saved override holds one"
    key = parsed.key_or_group
    if key.split("/")[0].split(".")[0] == "hydra" or key.startswith("hydra/"):
        return "Hydra's own settings are not a run's overrides"
    if any(HYDRA_KEYS.match(part) for part in re.split(r"[./@]", key)):
        return f"{key!r} is one of Hydra's instantiation keys"
    if parsed.is_delete():
        return None
    return _value_refusal(parsed.value(), key, base)


def _value_refusal(value: Any, key: str, base: Any) -> str | None:
    if isinstance(value, str):
        bad = [r for r in RESOLVER.findall(value) if r not in RESOLVERS]
        return f"the resolver {bad[0]!r} builds values when the config is read (accepted: {', '.join(RESOLVERS)})" \
            if bad else None
    if isinstance(value, Mapping):
        special = [k for k in value if isinstance(k, str) and HYDRA_KEYS.match(k)]
        if special:
            return f"{key}.{special[0]}: Hydra's instantiation keys are not data"
        if not _is_mapping_at(base, key):
            return f"a mapping for {key}, where lmlab's config holds none"
        return next((r for k, v in value.items() if (r := _value_refusal(v, f"{key}.{k}", base))), None)
    if isinstance(value, Sequence):
        for i, v in enumerate(value):
            if isinstance(v, Mapping):
                return f"a mapping inside the list {key}"
            if r := _value_refusal(v, f"{key}[{i}]", base):
                return r
    return None


def _is_mapping_at(base: Any, key: str) -> bool:
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(base, DictConfig):
        return False
    return isinstance(OmegaConf.select(base, key.lstrip("+~"), default=None, throw_on_missing=False), DictConfig)


def check_config(config: Any, path: Path) -> Any:
    """A config recorded in `path` (`.hydra/config.yaml`, summary.json's `config`): every `_target_` in its trainer
    and logger entries one lmlab builds, and none anywhere else. Returns it unchanged."""
    from lmlab.record.trusted import check_config_targets

    if not isinstance(config, Mapping):
        raise SavedStateRefused(f"{path}: the recorded config is a {type(config).__name__}, not a mapping")
    try:
        check_config_targets(config)
    except ValueError as err:
        raise SavedStateRefused(f"{path}: {err}") from None
    rest = {k: v for k, v in config.items() if k not in ("trainer", "logger")}
    if where := _target_in(rest, ""):
        raise SavedStateRefused(f"{path}: {where} names something to build, where lmlab's config holds data")
    return config


def _target_in(node: Any, key: str) -> str | None:
    if isinstance(node, Mapping):
        for k, v in node.items():
            here = f"{key}.{k}" if key else str(k)
            if isinstance(k, str) and HYDRA_KEYS.match(k) and k != "_convert_":
                return here
            if found := _target_in(v, here):
                return found
    elif isinstance(node, Sequence) and not isinstance(node, str):
        return next((f for i, v in enumerate(node) if (f := _target_in(v, f"{key}[{i}]"))), None)
    return None


# --- a sweep's recorded command (sweep.json), which `lmlab sweep resume` runs again ------------------------------

FLAGS = ("-m", "--multirun")  # a config directory or name (--config-dir, -cp, -cn) could point at anyone's YAMLs
# Hydra's own keys a sweep's command may set: scheduling requests and search settings, as scalars. Not the ones that
# run something (hydra.callbacks, a launcher's `setup` lines or extra sbatch parameters, hydra.job.env_set,
# hydra.searchpath, a search's custom_search_space, a `_target_` anywhere).
HYDRA_GROUPS = {"hydra/launcher": ("serial", "local", "slurm", "slurm_dry_run", "basic", "submitit_local",
                                   "submitit_slurm", "lmlab_submitit_slurm"),
                "hydra/sweeper": ("basic", "optuna")}
HYDRA_SCALARS = re.compile(
    r"^hydra\.(sweep\.(dir|subdir)|job\.config\.override_dirname\.exclude_keys"
    r"|launcher\.(timeout_min|cpus_per_task|gpus_per_node|tasks_per_node|mem_gb|nodes|name|partition|qos|comment"
    r"|constraint|exclude|gres|cpus_per_gpu|gpus_per_task|mem_per_gpu|mem_per_cpu|account|signal_delay_s"
    r"|max_num_timeout|array_parallelism|wait|stderr_to_stdout)"
    r"|sweeper\.(direction|study_name|n_trials|n_jobs|max_failure_rate|max_batch_size|sampler\.seed"
    r"|sampler\.n_startup_trials|params\.[\w.\-/]+))$")


def check_command(argv: Sequence[str], path: Path) -> list[str]:
    """The arguments of a sweep's recorded command (`path`: its sweep.json), each checked as data before `lmlab sweep
    resume` runs them: the sweep's own overrides (sweeps of values included), its launcher and search settings as
    scalars; anything that would run code or read configs from elsewhere is refused naming the argument and why."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for i, arg in enumerate(argv):
        if not isinstance(arg, str):
            raise SavedStateRefused(f"{path}: command[{i + 1}] is a {type(arg).__name__}, not an argument")
        reason = _command_refusal(arg, parser)
        if reason:
            raise SavedStateRefused(f"{path}: command[{i + 1}] {arg!r} is refused ({reason}); `lmlab sweep resume` "
                                    f"runs a sweep's recorded command only as data: if you trust it, run the command "
                                    f"yourself with hydra.sweep.dir=<the sweep>")
    return list(argv)


def _command_refusal(arg: str, parser: Any) -> str | None:
    if arg.startswith("-"):
        return None if arg in FLAGS else "a flag other than -m: it could read configs from elsewhere"
    try:
        parsed = parser.parse_override(arg)
    except Exception as err:  # noqa: BLE001  (Hydra's grammar error, any kind)
        return f"not an override: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
    key = parsed.key_or_group
    if any(HYDRA_KEYS.match(part) for part in re.split(r"[./@]", key)):
        return f"{key!r} is one of Hydra's instantiation keys"
    if key.startswith("hydra/"):
        allowed = HYDRA_GROUPS.get(key, ())
        return None if str(parsed.value()) in allowed else f"{key} accepts {', '.join(allowed) or 'nothing'} here"
    if key.split(".")[0] == "hydra":
        if not HYDRA_SCALARS.match(key):
            return f"{key} is not among the launcher and search settings a recorded sweep may set"
        value = parsed.value()
        if isinstance(value, Mapping) or (isinstance(value, Sequence) and not isinstance(value, str)
                                          and key != "hydra.job.config.override_dirname.exclude_keys"):
            return f"{key} takes a single value here"
    if parsed.is_sweep_override():
        text = arg.partition("=")[2]
        bad = [r for r in RESOLVER.findall(text) if r not in RESOLVERS]
        if bad:
            return f"the resolver {bad[0]!r} builds values when the config is read"
        return f"{key}: Hydra's instantiation keys are not data" if "_target_" in text else None
    if key.split(".")[0] == "hydra" or parsed.is_delete():
        return None
    return _value_refusal(parsed.value(), key, None)
