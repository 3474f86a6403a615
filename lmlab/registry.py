"""Pick a part by name: one plain dict per axis and one `build()` for all of them.

A spec is a mapping with a `name` key and the option's own keyword arguments, exactly as its
YAML file under `conf/<group>/` holds them. Unknown names, unknown keys and values of the wrong type or
outside their range fail here, before anything is trained, with a message that names the key as the user
types it (`optim.lr='abc' must be a float > 0`) and what it accepts.

Types and ranges come from the option's own signature: `lr: Annotated[float, Range(gt=0)] = 1e-3`. The same
check serves anything else with annotated values (GPTConfig's fields, `evaluate()`'s arguments).
"""

from __future__ import annotations

import functools
import inspect
import math
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from os import PathLike
from pathlib import Path
from typing import Annotated, Any, Literal

CONF_DIR = Path(__file__).resolve().parent / "conf"  # the YAMLs, shipped in the package (the checkout links conf/ to
                                                     # it)


def is_group(key: str) -> bool:
    """Whether `key` (an override's key) names a config group of lmlab's (`norm`, `hydra/launcher`): a plain name of
    CONF_DIR's folders, whatever the key holds (a 5,000-character key, `..`, a NUL: never a path to look up)."""
    return len(key) <= 100 and all(part.isidentifier() for part in key.split("/")) and (CONF_DIR / key).is_dir()



def gather(package: str, path: Iterable[str], attr: str) -> dict[str, Any]:
    """The options a package's own files declare, by importing each: its `attr` dict (`OPTIONS = {"mha": MHA}`), or
    its single `attr` object registered under the file's name (`OPTION = adan` in adan.py). A new option is its
    file, its YAML and its test; no registry to edit."""
    import importlib
    import pkgutil

    found: dict[str, Any] = {}
    for info in pkgutil.iter_modules(path):
        declared = vars(importlib.import_module(f"{package}.{info.name}")).get(attr)  # its own namespace
        if isinstance(declared, dict):
            found.update(declared)
        elif declared is not None:
            found[info.name] = declared
    return found


@dataclass(frozen=True)
class Range:
    """Bounds on a number, or on every element of a list: `Annotated[float, Range(gt=0)]`,
    `Annotated[tuple[float, float], Range(ge=0, lt=1)]`."""

    gt: float | None = None
    ge: float | None = None
    lt: float | None = None
    le: float | None = None

    def __contains__(self, x: float) -> bool:
        return ((self.gt is None or x > self.gt) and (self.ge is None or x >= self.ge)
                and (self.lt is None or x < self.lt) and (self.le is None or x <= self.le))

    def __str__(self) -> str:
        low = f"({self.gt:g}" if self.gt is not None else f"[{self.ge:g}" if self.ge is not None else None
        high = f"{self.lt:g})" if self.lt is not None else f"{self.le:g}]" if self.le is not None else None
        if low and high:
            return f"in {low}, {high}"
        bounds = [(">", self.gt), (">=", self.ge), ("<", self.lt), ("<=", self.le)]
        return " ".join(f"{op} {v:g}" for op, v in bounds if v is not None)


# The ranges most options need, by name; any other is `Annotated[<type>, Range(...)]` in the signature.
PositiveFloat = Annotated[float, Range(gt=0)]
NonNegativeFloat = Annotated[float, Range(ge=0)]
Fraction = Annotated[float, Range(ge=0, le=1)]
PositiveInt = Annotated[int, Range(ge=1)]
NonNegativeInt = Annotated[int, Range(ge=0)]
Betas = Annotated[tuple[float, float], Range(ge=0, lt=1)]  # an optimizer's moving-average coefficients, each in [0, 1)


def check_value(key: str, value: Any, annotation: Any) -> None:
    """Raise `ValueError("key=value must be <what the annotation accepts>")` unless `value` fits `annotation`."""
    if _fits(value, annotation):
        return
    what = _describe(annotation)
    if isinstance(value, float) and not math.isfinite(value):  # nan / inf: say so, it is easy to miss in a sweep
        raise ValueError(f"{key}={value!r} is not a finite number; it must be {what}")
    raise ValueError(f"{key}={value!r} must be {what}")


def check_values(prefix: str, values: Mapping[str, Any], annotations: Mapping[str, Any]) -> None:
    """`check_value` for each given key that has an annotation; keys are named `prefix + key`."""
    for key, value in values.items():
        if key in annotations:
            check_value(prefix + key, value, annotations[key])


@functools.cache
def parameter_types(fn: Callable, kinds: tuple[str, ...] = ("KEYWORD_ONLY",)) -> dict[str, Any]:
    """The evaluated annotation of each parameter of `fn` (a function, or a class: its __init__) of these kinds.

    Only the parameters asked for are evaluated: positional ones may name types imported for type checkers only
    (`cfg: GPTConfig` under TYPE_CHECKING), which would not evaluate at run time.
    """
    out = {}
    for p, owner in _parameters(fn):
        if p.kind.name in kinds:
            target = owner.__init__ if inspect.isclass(owner) else owner
            namespace = getattr(inspect.unwrap(target), "__globals__", None) or vars(sys.modules[owner.__module__])
            # `from __future__ import annotations` keeps annotations as strings; evaluate them where they were written.
            out[p.name] = eval(p.annotation, namespace) if isinstance(p.annotation, str) else p.annotation
    return out


def _parameters(fn: Callable) -> list[tuple[inspect.Parameter, Callable]]:
    """The parameters of `fn` (a function, or a class: its __init__), each with what declares it. A class whose
    __init__ takes `**shared` passes those keys to its base: the base's keyword-only parameters are its keys too (a
    variant inherits its base's keys, attention=mla takes every key attention=mha takes), its own first. A class that
    declares `PARTS` (a mapping of name -> part class) takes its parts' keyword-only parameters through its
    `**parts` as its keys too (the attention-wide features: lmlab.model.attention.parts)."""
    if not inspect.isclass(fn):
        return [(p, fn) for p in inspect.signature(fn).parameters.values()]
    out, seen = [], set()
    for cls in fn.__mro__:
        if "__init__" not in vars(cls) or cls is object:
            continue
        params = inspect.signature(cls.__init__).parameters.values()
        for p in params:
            if p.name not in seen and p.kind is not inspect.Parameter.VAR_KEYWORD and (not out or p.kind.name ==
                                                                                          "KEYWORD_ONLY"):
                seen.add(p.name)
                out.append((p, cls))
        for part in vars(cls).get("PARTS", {}).values():
            out += [(p, part) for p in inspect.signature(part.__init__).parameters.values()
                    if p.kind.name == "KEYWORD_ONLY" and p.name not in seen]
            seen |= {p.name for p, _ in out}
        if "PARTS" in vars(cls) or not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            break
    return [(p, owner) for p, owner in out if p.name != "self"]


def option_types(fn: Callable) -> dict[str, Any]:
    """The annotation of each option parameter (the keyword-only ones, named like the YAML keys; a variant's
    `**shared` ones are its base's)."""
    return parameter_types(fn)


def option_defaults(fn: Callable) -> dict[str, Any]:
    """The default of each option parameter that has one (the keyword-only ones, named like the YAML keys)."""
    return {p.name: p.default for p, _ in _parameters(fn)
            if p.kind.name == "KEYWORD_ONLY" and p.default is not inspect.Parameter.empty}


def option_params(group: str, registry: Mapping[str, Callable], spec: Mapping[str, Any],
                  keys: str | None = None) -> tuple[str, dict]:
    """Check a spec against its registry; return (name, keyword arguments). `keys`: where the option's keys sit, when
    not at `group.<key>` (a group of several options: `residual.scaled.<key>`)."""
    params = dict(spec)
    if "name" not in params:
        raise ValueError(f"{group} needs a 'name'; choose one of {sorted(registry)}")
    name = params.pop("name")
    if name not in registry:
        raise ValueError(f"{group}={name!r} is not an option; choose one of {sorted(registry)}")
    accepted = option_types(registry[name])
    if unknown := sorted(params.keys() - accepted.keys()):
        raise ValueError(f"{group}={name!r} does not take {unknown}; it takes {sorted(accepted)}")
    check_values(f"{keys or group}.", params, accepted)
    return name, params


def build(group: str, registry: Mapping[str, Callable], spec: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
    """`registry[spec.name](*args, **kwargs, **spec_without_name)`, with errors that list the choices."""
    name, params = option_params(group, registry, spec)
    return registry[name](*args, **kwargs, **params)


# --- what a value must be: `_fits` checks, `_describe` says it in the words of the YAML user ---

_LISTS = (list, tuple, Sequence, Iterable)  # a YAML list (an OmegaConf ListConfig) stands for any of these
_WORDS = {float: ("a float", "floats"), int: ("an integer", "integers"), bool: ("true or false", "booleans"),
          str: ("a string", "strings"), type(None): ("null", "nulls"), Path: ("a path", "paths")}


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, str | bytes)


def _fits(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is inspect.Parameter.empty:
        return True
    if origin is Annotated:
        ranges = [m for m in tp.__metadata__ if isinstance(m, Range)]
        items = list(value) if _is_list(value) else [value]  # a range on a list bounds each element
        return _fits(value, args[0]) and all(v in r for r in ranges for v in items if v is not None)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(value, arm) for arm in args)
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in args)
    if tp is float:  # an int is a float here (YAML `lr: 1`); a bool is not a number
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is Path:
        return isinstance(value, str | PathLike)
    if tp in _LISTS or origin in _LISTS:
        if not _is_list(value):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_fits(v, a) for v, a in zip(value, args))
        return not args or all(_fits(v, args[0]) for v in value)
    if tp in (dict, Mapping) or origin in (dict, Mapping):
        return isinstance(value, Mapping) and (not args or all(_fits(k, args[0]) and _fits(v, args[1])
                                                               for k, v in value.items()))
    return isinstance(value, tp) if isinstance(tp, type) else True  # e.g. a Protocol: not checked


def _describe(tp: Any, plural: bool = False) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        ranges = " ".join(str(m) for m in tp.__metadata__ if isinstance(m, Range))
        return f"{_describe(args[0], plural)} {ranges}".rstrip()
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(arm, plural) for arm in args)
    if origin is Literal:
        return f"one of {list(args)}"
    if tp in _WORDS:
        return _WORDS[tp][plural]
    if tp in _LISTS or origin in _LISTS:
        if plural:
            return "lists"
        if origin is tuple and args and args[-1] is not Ellipsis:
            kinds = {_describe(a, True) for a in args}
            return f"a list of {len(args)} {kinds.pop()}" if len(kinds) == 1 else \
                f"a list [{', '.join(_describe(a) for a in args)}]"
        return f"a list of {_describe(args[0], True)}" if args else "a list"
    if tp in (dict, Mapping) or origin in (dict, Mapping):
        return "mappings" if plural else "a mapping"
    name = getattr(tp, "__name__", str(tp))
    return f"{name} values" if plural else f"a {name}"
