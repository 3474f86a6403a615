"""What lmlab reads back from a run or sweep directory is data, never code: one reader, an allow-list.

A run or sweep directory is something users copy, share and download, and continuing one re-applies what it recorded:
a run's saved overrides (`.hydra/overrides.yaml`) and a sweep's recorded command (sweep.json). A line there is as
powerful as the command line that wrote it, so each is parsed with Hydra's own override grammar into (key, value) and
accepted only when it is what a command typed by a user could have meant and lmlab wrote itself:

- the key one of lmlab's config (the config composed with the file's own group choices), a `+key` only under an option
  group whose keys the option's signature checks (`+ffn.hidden=...`), no instantiation key (`_target_`, `_partial_`,
  ...) anywhere; of Hydra's own settings (`hydra.*`), only in a sweep's command and only the launcher and search
  settings lmlab writes, and the launchers and sweepers lmlab ships, by name;
- the value a literal of the key's shape: numbers, booleans, strings, null and lists of those (a mapping only where
  lmlab's config holds one, of literals too; a scalar of the wrong kind, optim.lr=abc, is data, which the key's own
  check refuses by name when the run starts). No `${` at all: an interpolation is resolved when the config is read,
  and a resolver's name can itself be an interpolation, so a value from a file holds none (one the user wants is
  typed on the command line, where it is theirs: a key the command sets is not read from the file);
- free of control characters (a newline in a launcher's string is a line of its sbatch script) and within LIMIT;
- a path that names code (a task YAML of `downstream.tasks`, whose `!function` imports Python beside it) only where
  the command line names it: from a file, only lmlab's own tasks by name. Output subdirectories stay inside the sweep.

Anything else is refused before anything is composed or built, naming the file, the line and the rule (exit 2 at the
commands). What lmlab instantiates from a config (the trainer, its strategy and plugins, the loggers) is checked on the
resolved config, which is then instantiated as it is (lmlab.record.trusted). The configs a run records
(`.hydra/config.yaml`, summary.json's `config`) are read as data too: only `_target_`s lmlab would build.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

HYDRA_KEYS = re.compile(r"^_[a-z]+_$")  # _target_, _partial_, _args_, _recursive_, _convert_
LIMIT = 4096  # characters of one saved override or recorded argument (a long data.paths list fits)
FILE_LIMIT = 1 << 20  # bytes of a saved overrides file
# Option groups whose keys an option's signature checks before anything is built (lmlab.registry): a `+key` there is a
# keyword the option takes or a refusal naming the key. Not trainer or logger: their keys pass to Lightning unchecked.
PLUS_GROUPS = ("activation", "attention", "block", "data", "ffn", "head", "init", "mixer", "model", "norm", "optim",
               "param", "placement", "position", "residual", "rope_scaling", "schedule")
CODE_PATHS = ("downstream.tasks",)  # keys whose paths name code to load: only from the command line

# Hydra's own settings a sweep's recorded command may hold: scheduling requests and search settings (not the ones
# that run something: hydra.callbacks, a launcher's `setup` lines or extra sbatch parameters, hydra.job.env_set,
# hydra.searchpath, a search's custom_search_space)
HYDRA_GROUPS = {"hydra/launcher": ("serial", "local", "slurm", "slurm_dry_run", "basic", "submitit_local",
                                   "submitit_slurm", "lmlab_submitit_slurm"),
                "hydra/sweeper": ("basic", "optuna")}
HYDRA_SETTINGS = ("hydra.sweep.dir", "hydra.sweep.subdir", "hydra.job.config.override_dirname.exclude_keys",
                  *(f"hydra.launcher.{k}" for k in (
                      "timeout_min", "cpus_per_task", "gpus_per_node", "tasks_per_node", "mem_gb", "nodes", "name",
                      "partition", "qos", "comment", "constraint", "exclude", "gres", "cpus_per_gpu", "gpus_per_task",
                      "mem_per_gpu", "mem_per_cpu", "account", "signal_delay_s", "max_num_timeout",
                      "array_parallelism", "wait", "stderr_to_stdout")),
                  *(f"hydra.sweeper.{k}" for k in ("direction", "study_name", "n_trials", "n_jobs", "max_failure_rate",
                                                   "max_batch_size", "sampler.seed", "sampler.n_startup_trials")))
SWEEPER_PARAMS = "hydra.sweeper.params."  # a search's parameters: hydra.sweeper.params.optim.lr=interval(...)
FLAGS = ("-m", "--multirun")  # a config directory or name (--config-dir, -cp, -cn) could point at anyone's YAMLs


class SavedStateRefused(ValueError):
    """A file of a run or sweep directory holds something lmlab will not act on (named: file, line, why)."""


@dataclass(frozen=True)
class Entry:
    """One saved override or recorded argument, parsed: its key (or group), value and form."""

    text: str
    key: str
    value: Any
    add: bool  # +key or ++key
    delete: bool  # ~key
    group: bool  # a config group's option (norm=rms), not a key
    sweep: bool


# --- one override: what holds without knowing the config ------------------------------------------------------------

def parse(text: Any, *, sweep: bool = False, hydra: bool = False) -> Entry | str:
    """`text` parsed into an Entry, or why it is refused (a str). `sweep`: a sweep of values is accepted (a sweep's
    command); `hydra`: Hydra's own settings from the allow-list are (a sweep's command, not a run's overrides)."""
    from lmlab.registry import CONF_DIR
    from lmlab.registry import is_group as is_group_key

    if not isinstance(text, str):
        return f"a {type(text).__name__}, not a key=value string"
    if len(text) > LIMIT:
        return f"{len(text):,} characters, over the {LIMIT:,} of a saved override"
    if bad := control_char(text):
        return f"a control character ({bad}): a saved value reaches shell lines and file names"
    if "${" in text:
        return ("an interpolation (`${`): a value read from a file is a literal (an interpolation you want is typed "
                "on the command line, where it is yours)")
    try:
        parsed = _parser().parse_override(text)
    except Exception as err:  # noqa: BLE001  (Hydra's grammar error, any kind)
        return f"not an override: {' '.join(str(err).split()) or type(err).__name__}"
    key = parsed.key_or_group
    if parsed.package is not None:
        return f"{key}@{parsed.package}: a package moves a config group, which lmlab never records"
    if any(HYDRA_KEYS.match(part) for part in re.split(r"[./]", key)):
        return f"{key!r} is one of Hydra's instantiation keys"
    if parsed.is_sweep_override() and not sweep:
        return "a sweep of values: a run's saved override holds one"
    value = None if parsed.is_delete() else parsed.value()
    is_group = is_group_key(key) or key.startswith("hydra/")
    if _is_hydra(key):
        if not hydra:
            return "Hydra's own settings are not a run's overrides"
        if why := _hydra_refusal(key, value):
            return why
    for literal in _values(value):
        if why := _literal_refusal(literal, key):
            return why
    if is_group and not key.startswith("hydra/") and not parsed.is_delete():
        options = sorted(p.stem for p in (CONF_DIR / key).glob("*.yaml"))
        for one in _leaves(value):  # residual=[value_embed,smear]: each an option
            if one is not None and (not isinstance(one, str) or one not in options):
                return f"{key} has no option {one!r} (the options: {', '.join(options)})"
    return Entry(text, key, value, parsed.is_add() or parsed.is_force_add(), parsed.is_delete(), is_group,
                 parsed.is_sweep_override())


@functools.cache
def _parser() -> Any:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create()


def _is_hydra(key: str) -> bool:
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def control_char(text: str) -> str | None:
    """The first control character of `text` as U+XXXX (a newline, NUL, an escape...), or None."""
    return next((f"U+{ord(c):04X}" for c in text if ord(c) < 32 or 127 <= ord(c) < 160), None)


def _values(value: Any) -> list[Any]:
    """The literals a parsed value stands for: itself, or each value of a sweep (choice, range, interval, glob)."""
    from hydra.core.override_parser.types import ChoiceSweep, Glob, IntervalSweep, RangeSweep

    if isinstance(value, ChoiceSweep):
        return list(value.list)
    if isinstance(value, RangeSweep):
        return [value.start, value.stop or None]
    if isinstance(value, IntervalSweep):
        return [value.start, value.end]
    if isinstance(value, Glob):
        return [*value.include, *value.exclude]
    return [value]


def _leaves(value: Any) -> list[Any]:
    """The scalars a parsed value stands for: each value of a sweep, each item of a list (residual=[a,b])."""
    return [leaf for v in _values(value) for leaf in (v if isinstance(v, list) else [v])]


def _literal_refusal(value: Any, key: str) -> str | None:
    """Why `value` is not a literal (None: it is): numbers, booleans, strings, null, lists and mappings of those,
    with no interpolation, control character or instantiation key anywhere."""
    if value is None or isinstance(value, bool | int | float):
        return None
    if isinstance(value, str):
        if "${" in value:
            return f"{key}: an interpolation (`${{`) is not a literal"
        if bad := control_char(value):
            return f"{key}: a control character ({bad})"
        return None
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, str) or HYDRA_KEYS.match(k) or "${" in k or control_char(k):
                return f"{key}.{k}: Hydra's instantiation keys are not data" if isinstance(k, str) and \
                    HYDRA_KEYS.match(k) else f"{key}: the key {k!r} is not a plain name"
            if why := _literal_refusal(v, f"{key}.{k}"):
                return why
        return None
    if isinstance(value, list):
        return next((why for i, v in enumerate(value) if (why := _literal_refusal(v, f"{key}[{i}]"))), None)
    return f"{key}: a {type(value).__name__} is not a literal"


def _hydra_refusal(key: str, value: Any) -> str | None:
    if key.startswith("hydra/"):
        allowed = HYDRA_GROUPS.get(key, ())
        chosen = [str(v) for v in _values(value)]
        return None if chosen and all(v in allowed for v in chosen) else \
            f"{key} accepts {', '.join(allowed) or 'nothing'} here"
    if key.startswith(SWEEPER_PARAMS):
        return None if isinstance(value, str | int | float | bool) or value is None else \
            f"{key} takes a search expression (interval(...), choice(...)) here"
    if key not in HYDRA_SETTINGS:
        return f"{key} is not among the launcher and search settings a recorded sweep may set"
    if key == "hydra.job.config.override_dirname.exclude_keys":
        return None if isinstance(value, list) and all(isinstance(v, str) for v in value) else \
            f"{key} takes a list of keys"
    if isinstance(value, Mapping | list):
        return f"{key} takes a single value here"
    if key == "hydra.sweep.subdir":
        sub = PurePosixPath(str(value))
        if sub.is_absolute() or ".." in sub.parts:
            return f"{key}={value!r}: a job's directory is inside the sweep's (no absolute path, no `..`)"
    return None


# --- overrides against lmlab's config: keys it has, values of their type ---------------------------------------------

def check_entries(entries: Sequence[tuple[str, Entry]], schema: Any, typed: Sequence[str] = ()) -> None:
    """Each (where, entry) against `schema`, the config composed with the entries' group choices: the key lmlab's (or
    a `+key` of an option group), the value of its type, a code path only as the command line names it (`typed`).
    Raises SavedStateRefused naming `where` and why."""
    named = {str(v) for t in typed for v in typed_values(t)}
    for where, entry in entries:
        if entry.group or _is_hydra(entry.key):
            continue
        node = _node(schema, entry.key)  # (a config Hydra cannot compose: no key is known to be lmlab's)
        why = None
        if node is _MISSING:
            if not (entry.add and entry.key.split(".")[0] in PLUS_GROUPS):
                why = (f"{entry.key} is not a key of lmlab's config (a `+key` only under "
                       f"{', '.join(PLUS_GROUPS)})")
        elif not entry.delete:
            why = next((w for v in _values(entry.value) if (w := _type_refusal(v, node, entry.key))), None)
        if why is None and entry.key in CODE_PATHS:
            paths = [p for p in _leaves(entry.value)
                     if isinstance(p, str) and ("/" in p or p.endswith((".yaml", ".yml")))]
            if outside := [p for p in paths if p not in named]:
                why = (f"{entry.key}: {outside[0]} is a task file, which imports code: from a file only lmlab's tasks "
                       f"by name; name the file on this command line to use it")
        if why:
            raise SavedStateRefused(f"{where}: {entry.text!r} is refused ({why})")


_MISSING = object()


def _node(schema: Any, key: str) -> Any:
    """What lmlab's config `schema` holds at the dotted `key`: a DictConfig or ListConfig, a leaf's raw value (None
    for a required `???` one), or _MISSING where it has no such key."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    node = schema
    for part in key.split("."):
        if not isinstance(node, DictConfig) or part not in [str(k) for k in node.keys()]:
            return _MISSING
        node = node._get_node(part)
    if isinstance(node, DictConfig | ListConfig):
        return node
    value = node._value()
    return None if OmegaConf.is_missing(node._get_parent(), key.rpartition(".")[2]) else value


def typed_values(text: str) -> list[Any]:
    """The scalars of an override typed on the command line, parsed with Hydra's grammar ([] when it does not
    parse: Hydra reports that itself)."""
    try:
        return _leaves(_parser().parse_override(text).value())
    except Exception:  # noqa: BLE001
        return []


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}  # what a scalar key holds


def _type_refusal(value: Any, node: Any, key: str) -> str | None:
    """Why `value` cannot be a value of `key`, whose config holds `node` (None: it can)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if value is None or node is None or (isinstance(node, str) and "${" in node):
        return None  # null is every key's; an unset or interpolated key takes any literal
    if isinstance(node, DictConfig):
        if not isinstance(value, Mapping):
            return None if not isinstance(value, list) else f"{key} holds a mapping, not a list"
        for k, v in value.items():
            sub = OmegaConf.select(node, str(k), default=None, throw_on_missing=False)
            if why := _type_refusal(v, sub, f"{key}.{k}"):
                return why
        return None
    if isinstance(value, Mapping):
        if isinstance(node, ListConfig):  # a list of mappings (data=mixture's sources)
            return None
        return f"a mapping for {key}, where lmlab's config holds {_KINDS.get(type(node), 'a value')}"
    if isinstance(node, ListConfig):
        if isinstance(value, list) and any(isinstance(v, Mapping) for v in value) and not any(
                isinstance(v, DictConfig) for v in node) and len(node):
            return f"a mapping inside the list {key}"
        return None
    if isinstance(value, list):
        return None if not any(isinstance(v, Mapping) for v in value) else f"a mapping inside the list {key}"
    # A scalar of another kind (optim.lr=abc) is data all the same: the key's own check refuses it naming the key
    # (a run before it starts, a sweep's job as a failed job while the sweep goes on)
    return None


# --- a run's saved overrides ----------------------------------------------------------------------------------------

def read_overrides(path: Path, typed: Sequence[str] | None = None, config_name: str = "train") -> list[str]:
    """The overrides saved in `path` (a YAML list of key=value strings) that a command continues with: each checked
    (parse, then check_entries against lmlab's config composed with their group choices). `typed`, the command's own
    overrides: a key they set replaces the saved line, which is then neither read nor returned (None: every line is
    checked and returned, as for reading a run back)."""
    from lmlab.cli import override_key

    lines = _yaml_strings(path)
    replaced = {override_key(t) for t in typed or ()}
    entries: list[tuple[str, Entry]] = []
    for line, text in lines:
        if typed is not None and isinstance(text, str) and override_key(text) in replaced:
            continue
        entry = parse(text)
        if isinstance(entry, str):
            raise SavedStateRefused(_refused(f"{path}:{line}", text, entry))
        entries.append((f"{path}:{line}", entry))
    schema = _schema([e for _, e in entries], typed or (), config_name)
    try:
        check_entries(entries, schema, typed or ())
    except SavedStateRefused as err:
        raise SavedStateRefused(f"{err}; {_ADVICE}") from None
    return [e.text for _, e in entries]


_ADVICE = ("a run directory's saved overrides are key=value data: type the value on this command line to use it, "
           "remove the line to continue without it, or start over with resume=false overwrite=true")


def _refused(where: str, text: Any, why: str, advice: str = _ADVICE) -> str:
    shown = repr(text) if not isinstance(text, str) or len(text) <= 200 else repr(text[:200] + "...")
    return f"{where}: {shown} is refused ({why}); {advice}"


def saved_lines(path: Path) -> list[str]:
    """The strings of the saved overrides file `path`, unchecked beyond being a YAML list of strings: to show and
    compare, never to apply (read_overrides)."""
    return [text for _, text in _yaml_strings(path)]


def _yaml_strings(path: Path) -> list[tuple[int, Any]]:
    """(line, item) of the YAML list in `path`; refuses a file over FILE_LIMIT, one that is not YAML or not a list,
    and an item that is not a plain string."""
    import yaml

    size = path.stat().st_size
    if size > FILE_LIMIT:
        raise SavedStateRefused(f"{path}: {size:,} bytes, over the {FILE_LIMIT:,} of a saved overrides file")
    text = path.read_text(errors="replace")
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise SavedStateRefused(f"{path}: not valid YAML ({first})") from None
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
        out.append((line, item.value))
    return out


def _schema(entries: Sequence[Entry], typed: Sequence[str], config_name: str) -> Any:
    """lmlab's config composed with the group choices of `entries` (a sweep's: its first value) and the command's
    own: the keys and types the entries are checked against (None when it cannot be composed: Hydra's own composition
    then reports why, and the entries are still literals)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from lmlab.cli import override_key
    from lmlab.registry import CONF_DIR
    from lmlab.registry import is_group as is_group_key

    mine = {override_key(t) for t in typed}
    choices = [f"{e.key}={_first(e.value)}" if e.sweep else e.text for e in entries
               if e.group and not _is_hydra(e.key) and not e.delete and e.key not in mine]
    choices += [t for t in typed if is_group_key(override_key(t)) and not t.startswith(("+", "~"))]
    try:
        if GlobalHydra.instance().is_initialized():  # inside a command's Hydra app: its own composition, left as it is
            return compose(config_name=config_name, overrides=choices)
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name=config_name, overrides=choices)
    except Exception:  # noqa: BLE001  (Hydra's composition reports it in its own words)
        return None


def _first(value: Any) -> Any:
    values = _values(value)
    return values[0] if values else None


# --- a sweep's recorded command (sweep.json), which `lmlab sweep resume` runs again ------------------------------

def check_command(argv: Sequence[Any], path: Path, typed: Sequence[str] = ()) -> list[str]:
    """The arguments of a sweep's recorded command (`path`: its sweep.json), each checked as data before `lmlab sweep
    resume` runs them: its overrides (sweeps of values included) by the rules of a run's, its launcher and search
    settings from the allow-list. `typed`: the resume's own key=value arguments, which replace the recorded ones of
    their keys: those are neither checked nor returned. Returns the arguments to run again."""
    from lmlab.cli import override_key

    entries: list[tuple[str, Entry]] = []
    replaced = {override_key(t) for t in typed}
    for i, arg in enumerate(argv):
        where = f"{path}: command[{i + 1}]"
        if isinstance(arg, str) and arg.startswith("-") and not arg.startswith("-="):
            if arg not in FLAGS:
                raise SavedStateRefused(_refused(where, arg, "a flag other than -m: it could read configs from "
                                                             "elsewhere", _SWEEP_ADVICE))
            continue
        if isinstance(arg, str) and override_key(arg) in replaced:
            continue
        entry = parse(arg, sweep=True, hydra=True)
        if isinstance(entry, str):
            raise SavedStateRefused(_refused(where, arg, entry, _SWEEP_ADVICE))
        entries.append((where, entry))
    schema = _schema([e for _, e in entries], typed, "train")
    swept_groups = {e.key for _, e in entries if e.group and e.sweep}
    try:  # a key under a swept group may be another option's: the option's signature checks it when each job starts
        check_entries([(w, e) for w, e in entries if e.key.split(".")[0] not in swept_groups], schema, typed)
    except SavedStateRefused as err:
        raise SavedStateRefused(f"{err}; {_SWEEP_ADVICE}") from None
    return [a for a in argv if isinstance(a, str) and not (override_key(a) in replaced and not a.startswith("-"))]


_SWEEP_ADVICE = ("`lmlab sweep resume` runs a sweep's recorded command only as data: if you trust it, run the command "
                 "yourself with hydra.sweep.dir=<the sweep>")


# --- the configs a run records ----------------------------------------------------------------------------------------

def check_config(config: Any, path: Path) -> Any:
    """A config recorded in `path` (`.hydra/config.yaml`, summary.json's `config`): every `_target_` in its trainer
    and logger entries one lmlab builds, and none anywhere else. Returns it unchanged."""
    from lmlab.record.trusted import check_config_targets

    if not isinstance(config, Mapping):
        raise SavedStateRefused(f"{path}: the recorded config is a {type(config).__name__}, not a mapping")
    try:
        check_config_targets(config, resolve=False)
    except ValueError as err:
        raise SavedStateRefused(f"{path}: {err}") from None
    rest = {k: v for k, v in config.items() if k not in ("trainer", "logger")}
    if where := _target_in(rest, ""):
        raise SavedStateRefused(f"{path}: {where} names something to build, where lmlab's config holds data")
    if found := _resolver_in(config, ""):
        raise SavedStateRefused(f"{path}: {found[0]}={found[1]!r}: a recorded config calls only the resolvers that "
                                f"compute a value ({', '.join(PURE_RESOLVERS)}), by a name written out")
    return config


# The resolvers a recorded config may call (its `.hydra/config.yaml` keeps lmlab's own interpolations unresolved):
# each computes a value from its arguments. Not oc.create or oc.decode (they make configs, `_target_`s included),
# not lmlab.sqlite (it makes a directory), not one whose name is itself an interpolation.
PURE_RESOLVERS = ("oc.env", "now", "lmlab.step_at", "lmlab.equal_flops_width", "lmlab.dirname")


def resolver_names(text: str) -> list[str] | None:
    """The names of the resolvers `text` calls, parsed with OmegaConf's own grammar (None: not a valid value)."""
    from antlr4 import ParserRuleContext  # OmegaConf's grammar runtime
    from omegaconf.grammar.gen.OmegaConfGrammarParser import OmegaConfGrammarParser
    from omegaconf.grammar_parser import parse as parse_value

    try:
        tree = parse_value(text)
    except Exception:  # noqa: BLE001  (OmegaConf's grammar error)
        return None
    names: list[str] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, OmegaConfGrammarParser.InterpolationResolverContext):
            names.append(node.resolverName().getText())
        if isinstance(node, ParserRuleContext):  # a terminal token has no children
            stack.extend(node.children or [])
    return names


def _resolver_in(node: Any, key: str) -> tuple[str, str] | None:
    """(key, value) of the first string in a recorded config that calls a resolver outside PURE_RESOLVERS."""
    if isinstance(node, str):
        if "${" not in node:
            return None
        names = resolver_names(node)
        return None if names is not None and all(n in PURE_RESOLVERS for n in names) else (key, node)
    if isinstance(node, Mapping):
        return next((f for k, v in node.items() if (f := _resolver_in(v, f"{key}.{k}" if key else str(k)))), None)
    if isinstance(node, list):
        return next((f for i, v in enumerate(node) if (f := _resolver_in(v, f"{key}[{i}]"))), None)
    return None


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
