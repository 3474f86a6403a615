"""The saved-state reader against thousands of generated override lines (issue 59): each line mixes interpolations,
resolvers whose names are themselves interpolations, escapes, quotes, mappings, `_target_`, control characters and
long strings, and each is either refused or parsed to a literal of its key's shape — never a value with `${`, never a
mapping with an instantiation key, never a control character, and one that OmegaConf resolves to itself (no resolver
is ever called on it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from lmlab import compose
from lmlab.record.saved import LIMIT, Entry, SavedStateRefused, check_entries, parse

KEYS = ["norm", "norm.eps", "optim.lr", "trainer.max_steps", "trainer.strategy", "trainer.plugins", "data.paths",
        "data.cache_dir", "logger", "perf.tag", "hydra.run.dir", "hydra.sweeper.direction", "hydra/launcher",
        "model.n_layer", "downstream.tasks", "ffn.hidden", "seed", "trainer._target_", "x._partial_", "residual"]
WORDS = ["rms", "layer", "create", "oc.create", "oc.decode", "oc.env", "torch.save", "os.system", "_target_",
         "lightning.pytorch.Trainer", "/tmp/pwned", "../x", "slurm", "pre", "1e-3", "true", "null", "shakespeare_mc"]
CONTROL = ["\n", "\r", "\x00", "\x1b", "\t", "\x7f", "\x85"]


def _scalar() -> st.SearchStrategy[str]:
    return st.one_of(st.sampled_from(WORDS), st.integers(-5, 10**6).map(str),
                     st.floats(allow_nan=False, allow_infinity=False).map(repr),
                     st.text(alphabet="ab${}:\\'\". _-/", max_size=12), st.sampled_from(CONTROL),
                     st.integers(1, 3).map(lambda n: "a" * (LIMIT // 2 * n)))


def _interpolated(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    return st.one_of(
        st.tuples(st.sampled_from(WORDS), inner).map(lambda t: f"${{{t[0]}:{t[1]}}}"),  # ${resolver:arg}
        st.tuples(st.sampled_from(["oc.", "lmlab.", ""]), inner, inner).map(
            lambda t: f"${{{t[0]}${{{t[1]}}}:{t[2]}}}"),  # ${oc.${key}:arg}: a resolver named by an interpolation
        inner.map(lambda v: f"${{{v}}}"), inner.map(lambda v: f"\\${{{v}}}"),  # a reference, an escaped one
        inner.map(lambda v: f"'{v}'"), inner.map(lambda v: f'"{v}"'))  # quoted


def _value() -> st.SearchStrategy[str]:
    return st.recursive(_scalar(), lambda inner: st.one_of(
        _interpolated(inner),
        st.lists(inner, max_size=3).map(lambda vs: f"[{','.join(vs)}]"),
        st.lists(st.tuples(st.sampled_from(["_target_", "a", "_partial_", "${x}", "checkpoint_io"]), inner),
                 max_size=3).map(lambda kv: "{" + ",".join(f"{k}: {v}" for k, v in kv) + "}"),
        st.lists(inner, min_size=2, max_size=3).map(",".join),  # a sweep
        st.tuples(st.sampled_from(["choice", "str", "int", "range", "glob"]), inner).map(lambda t: f"{t[0]}({t[1]})"),
    ), max_leaves=6)


LINES = st.tuples(st.sampled_from(["", "+", "++", "~"]), st.sampled_from(KEYS), st.sampled_from(["=", "@a=", "="]),
                  _value()).map(lambda t: f"{t[0]}{t[1]}{t[2]}{t[3]}" if t[0] != "~" else f"~{t[1]}")

SCHEMA = compose([])


def _literal_leaves(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        for key in value:
            assert isinstance(key, str) and not (key.startswith("_") and key.endswith("_")), value
            assert "${" not in key
        return [leaf for v in value.values() for leaf in _literal_leaves(v)]
    if isinstance(value, list):
        return [leaf for v in value for leaf in _literal_leaves(v)]
    return [value]


@settings(max_examples=2000, deadline=None, suppress_health_check=list(HealthCheck))
@given(line=LINES, sweep=st.booleans())
def test_every_generated_line_is_refused_or_a_literal_of_its_key(line: str, sweep: bool) -> None:
    entry = parse(line, sweep=sweep, hydra=sweep)
    if isinstance(entry, str):
        return  # refused, with the reason
    assert isinstance(entry, Entry) and len(line) <= LIMIT
    assert not any(ord(c) < 32 or 127 <= ord(c) < 160 for c in line)
    assert "${" not in line
    values = [entry.value]
    if entry.sweep:
        from lmlab.record.saved import _values

        values = _values(entry.value)
    for value in values:
        for leaf in _literal_leaves(value):
            assert leaf is None or isinstance(leaf, bool | int | float | str), (line, leaf)
            if isinstance(leaf, str):
                assert "${" not in leaf and not any(ord(c) < 32 for c in leaf), (line, leaf)
        # OmegaConf resolves it to itself: no interpolation, no resolver is ever called on it
        node = OmegaConf.create({"v": value})
        assert OmegaConf.to_container(node, resolve=True) == OmegaConf.to_container(node, resolve=False), line
    if entry.key.split(".")[0] in ("trainer", "logger") or entry.key.startswith("hydra"):
        try:
            check_entries([("overrides.yaml:1", entry)], SCHEMA)
        except SavedStateRefused:
            return
        assert not any(isinstance(v, Mapping) for v in values), line  # the trainer and loggers take no mapping here
