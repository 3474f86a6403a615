"""Pick a part by name: one plain dict per axis and one `build()` for all of them.

A spec is a mapping with a `name` key and the option's own keyword arguments, exactly as its
YAML file under `conf/<group>/` holds them. Unknown names and unknown keys fail here, before
anything is trained, with a message that names the group and the accepted values.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any


def option_params(group: str, registry: Mapping[str, Callable], spec: Mapping[str, Any]) -> tuple[str, dict]:
    """Check a spec against its registry; return (name, keyword arguments)."""
    params = dict(spec)
    if "name" not in params:
        raise ValueError(f"{group} needs a 'name'; choose one of {sorted(registry)}")
    name = params.pop("name")
    if name not in registry:
        raise ValueError(f"{group}={name!r} is not an option; choose one of {sorted(registry)}")
    accepted = {
        p.name for p in inspect.signature(registry[name]).parameters.values() if p.kind == p.KEYWORD_ONLY
    }
    if unknown := sorted(params.keys() - accepted):
        raise ValueError(f"{group}={name!r} does not take {unknown}; it takes {sorted(accepted)}")
    return name, params


def build(group: str, registry: Mapping[str, Callable], spec: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    """`registry[spec.name](*args, **kwargs, **spec_without_name)`, with errors that list the choices."""
    name, params = option_params(group, registry, spec)
    return registry[name](*args, **kwargs, **params)
