"""Command-line helpers shared by train.py and eval.py (run before Hydra parses sys.argv)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

# Path keys whose values Hydra's grammar rejects unquoted when they hold non-ASCII characters (`data.paths=[/d/é]`
# gives LexerNoViableAltException); quoted for the user when they do, left as typed otherwise.
UNICODE_PATH_KEYS = ("data.paths", "hf_data_paths", "hydra.run.dir", "hydra.sweep.dir", "data.cache_dir")

# How each command was invoked (set by lmlab/commands: `python train.py` from a checkout, `lmlab train` installed):
# the prefix of its refusals and the command its hints print.
PROG = {"train": "python train.py", "eval": "python eval.py", "generate": "python generate.py"}

# The arguments each command was typed with (before lmlab added its own, such as dirname_exclusions'): what a sweep's
# manifest records as its command, to run again on `lmlab sweep resume`.
TYPED: dict[str, list[str]] = {}


def typed_command(command: str = "train") -> list[str]:
    """[prog, *the arguments as typed] of `command` in this process (sys.argv when it was not started through
    lmlab.commands)."""
    import sys

    return [PROG[command], *TYPED.get(command, sys.argv[1:])]


# Keys a run may change when it is continued (lmlab/run/plan.py refuses an architecture change, not these): a sweep
# job's
# directory name leaves them out when the command sets them once for every job, so that the same sweep command with
# more steps (or another logger) continues its jobs in place. Swept (`trainer.max_steps=100,200`) they stay in it.
RESUMABLE_KEYS = ("trainer.max_steps", "trainer.val_check_interval", "trainer.log_every_n_steps", "logger", "logger.",
                  "monitor.", "perf.", "threads", "resume", "malloc", "targets", "ledger")


def resumable(key: str) -> bool:
    """Whether `key` may change when a run is continued (RESUMABLE_KEYS; a trailing dot covers the whole group)."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_KEYS)


def dirname_exclusions(argv: Sequence[str]) -> list[str]:
    """For a sweep (`-m`): the override `hydra.job.config.override_dirname.exclude_keys=[...]` that leaves out of its
    job directories' names the resumable keys the command sets to one value (Hydra's own setting; [] when there is
    nothing to leave out, when the command sets it itself, or outside a sweep)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not ({"-m", "--multirun", "hydra.mode=MULTIRUN"} & set(argv)) or any(
            override_key(a).startswith("hydra.job.config.override_dirname") for a in argv):
        return []
    parser, keys = OverridesParser.create(), []
    for arg in argv:
        if arg.startswith("-") or "=" not in arg or override_key(arg).startswith("hydra"):
            continue
        try:
            override = parser.parse_override(arg)
        except Exception:  # noqa: BLE001  (Hydra reports it, in its own words, when it parses the command line)
            continue
        if not override.is_sweep_override() and resumable(override.key_or_group):
            keys.append(override.key_or_group)
    return [f"hydra.job.config.override_dirname.exclude_keys=[{','.join(keys)}]"] if keys else []


def continue_command(run_dir: object) -> str:
    """The command that continues the run in `run_dir`, ready to paste into a shell (its own overrides are kept)."""
    import shlex

    return f"{PROG['train']} hydra.run.dir={shlex.quote(str(run_dir))}"


def quote_paths(argv: Sequence[str], keys: Iterable[str]) -> list[str]:
    """Quote the values of path keys for Hydra's parser: Hydra names sweep jobs by their overrides, so run
    directories hold '=' and ',' (`multirun/.../experiment=x,position=rope`), which Hydra would otherwise read
    as syntax. Values already quoted are left alone. The values (or list items) of UNICODE_PATH_KEYS that hold
    non-ASCII characters are quoted too."""
    keys = set(keys)
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in keys and value.startswith("[") and value.endswith("]"):  # a list: each item quoted
            if not set("'\"") & set(value):  # (one the user quoted is left as typed)
                items = [i.strip() for i in value[1:-1].split(",") if i.strip()]
                arg = f"{key}=[{','.join(repr(i) for i in items)}]"
        elif eq and key in keys and value and value[0] not in "'\"":
            arg = f"{key}='{value}'"
        elif eq and key.lstrip("+") in UNICODE_PATH_KEYS and not value.isascii():
            arg = f"{key}={_quote_unicode(value)}"
        out.append(arg)
    return out


def _quote_unicode(value: str) -> str:
    """A path, or a [list, of, paths], with each non-ASCII item quoted (items already quoted are left alone)."""
    def one(item: str) -> str:
        item = item.strip()
        return item if item.isascii() or item[:1] in ("'", '"') or "'" in item else f"'{item}'"

    if value.startswith("[") and value.endswith("]"):
        return "[" + ",".join(one(v) for v in value[1:-1].split(",")) + "]"
    return one(value)


def as_lists(argv: Sequence[str], keys: dict[str, str]) -> list[str]:
    """`key=a,b` -> `name=[a,b]` for keys that take a list (outside a sweep Hydra would reject `a,b`), renamed
    where the key is also a config group (`rope_scaling=yarn` would select conf/rope_scaling/yarn.yaml)."""
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in keys:
            arg = f"{keys[key]}={value if value.startswith('[') else f'[{value}]'}"
        out.append(arg)
    return out


def override_key(override: str) -> str:
    """The key an override sets: `norm` for norm=rms, `trainer.max_steps` for +trainer.max_steps=5 or ~trainer.x."""
    return override.partition("=")[0].lstrip("+~")


def merge_overrides(base: Sequence[str], new: Sequence[str]) -> list[str]:
    """A run's saved overrides with a new command's on top: every key the new command sets replaces the base's (in
    its place in the new list), the rest of the base is kept in its order, first."""
    changed = {override_key(o) for o in new}
    return [o for o in base if override_key(o) not in changed] + list(new)
