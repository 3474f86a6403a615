"""Command-line helpers shared by train.py and eval.py (run before Hydra parses sys.argv)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def quote_paths(argv: Sequence[str], keys: Iterable[str]) -> list[str]:
    """Quote the values of path keys for Hydra's parser: Hydra names sweep jobs by their overrides, so run
    directories hold '=' and ',' (`multirun/.../experiment=x,position=rope`), which Hydra would otherwise read
    as syntax. Values already quoted are left alone."""
    keys = set(keys)
    out = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if eq and key in keys and value and value[0] not in "'\"":
            arg = f"{key}='{value}'"
        out.append(arg)
    return out


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
