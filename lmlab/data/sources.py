"""A mixture's sources (`data=mixture`, lmlab/data/mixture.py), read and checked without Lightning: lmlab.run.checks
refuses a bad one before anything is built.

`data.sources` maps a source's name to its corpus: `name` (its kind: any corpus option, `text_files` when left out,
or `token_bin`), `weight` (a number > 0; only the ratios count) and that kind's own keys (`paths` for text_files,
`dataset` ... for hf, `train`, `val`, `val_tokens` for token_bin). The source's name becomes its metric,
`val/loss/<name>`, hence an identifier. The weights become shares of a chunk of `CHUNK` training blocks (`shares`).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from lmlab.data.corpus import CORPORA
from lmlab.registry import PositiveInt, check_values, option_types

NAME = "mixture"
CHUNK = 1 << 16  # every run of CHUNK training blocks holds exactly shares(weights)[s] blocks of source s
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
EXAMPLE = "'data.sources={web: {paths: [/a], weight: 0.7}, code: {paths: [/b], weight: 0.3}}'"
TOKENIZERS = ("char", "bpe")  # trained on the text (lmlab.data.tokenizer.TOKENIZERS, which imports `tokenizers`)


@dataclass(frozen=True)
class BinSource:
    """A token_bin source: its shards' globs, opened by the mixture (which knows the vocabulary they must fit)."""

    train: str
    val: str
    val_tokens: int | None
    cache_dir: Path


def load_token_bin(*, train: str, val: str, val_tokens: PositiveInt | None = None,
                   cache_dir: str | Path) -> BinSource:
    """Pre-tokenized .bin shards (lmlab.data.token_bin's layout): `train`, `val` globs; `val_tokens`, the first tokens
    of the val shards that validate (null: as many as data.val_windows blocks take)."""
    return BinSource(train, val, val_tokens, Path(cache_dir).expanduser())


KINDS = {**CORPORA, "token_bin": load_token_bin}  # what a source may be (its `name`)
_OWN = ("name", "weight")  # the keys every source takes besides its kind's


class Source(NamedTuple):
    name: str  # its key under data.sources, and its metric's last part
    kind: str  # a key of KINDS
    weight: float
    params: dict[str, Any]  # its kind's keys


def check_sources(data: dict[str, Any]) -> list[Source]:
    """`data.sources` checked by key (the files are the data module's to find): the sources in name order."""
    sources = data.get("sources")
    if sources is None or sources == "???":
        raise ValueError(f"data.sources is required with data=mixture: each source's name, weight and corpus, e.g. "
                         f"{EXAMPLE}")
    if not isinstance(sources, dict):
        raise ValueError(f"data.sources must be a mapping of source names to sources, not {sources!r:.80}; e.g. "
                         f"{EXAMPLE}")
    if not sources:
        raise ValueError(f"data.sources={{}} names no source; give one or more, e.g. {EXAMPLE}")
    out = [_source(str(name), spec) for name, spec in sorted(sources.items(), key=lambda kv: str(kv[0]))]
    for s, n in zip(out, shares([s.weight for s in out]), strict=True):
        if n == 0:
            total = sum(s.weight for s in out)
            raise ValueError(f"data.sources.{s.name}.weight={s.weight!r} is too small: less than 1/{CHUNK} of the "
                             f"weights' sum ({total:g}), so no block of {CHUNK} would come from it; raise it or leave "
                             f"the source out")
    if data.get("packing", "packed") != "packed":
        raise ValueError(f"data.packing={data['packing']} is not read by data=mixture: its sources are packed into "
                         f"full blocks; set data.packing=packed (padded rows: data=text_files, shakespeare or hf)")
    kind = str(data.get("tokenizer"))
    for s in out:
        if s.kind == "token_bin" and kind in TOKENIZERS:
            raise ValueError(f"data.sources.{s.name} is token_bin, whose ids are those of the tokenizer that wrote "
                             f"them, but data.tokenizer={kind} trains another: set data.tokenizer to that "
                             f"tokenizer.json (GPT-2's for the speedrun's shards); the text sources are tokenized "
                             f"with it too")
    return out


def _source(name: str, spec: Any) -> Source:
    if not _IDENTIFIER.fullmatch(name):
        raise ValueError(f"data.sources: {name!r} is not a valid source name: a source's name becomes its metric, "
                         f"val/loss/<name>, so it takes letters, digits and underscores (up to 64), starting with a "
                         f"letter or an underscore")
    if not isinstance(spec, dict):
        raise ValueError(f"data.sources.{name} must be a mapping (name, weight and that kind's keys), not {spec!r:.80}")
    params = dict(spec)
    kind = params.pop("name", None) or "text_files"
    if kind not in KINDS:
        raise ValueError(f"data.sources.{name}.name={kind!r} is not a source kind; choose one of {sorted(KINDS)} "
                         f"(text_files when left out)")
    if "weight" not in params:
        raise ValueError(f"data.sources.{name}.weight is required: a number > 0 (only the ratios between the "
                         f"sources' weights count)")
    weight = params.pop("weight")
    if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"data.sources.{name}.weight={weight!r} must be a number > 0 (only the ratios between the "
                         f"sources' weights count)")
    loader = KINDS[kind]
    accepted = {k: t for k, t in option_types(loader).items() if k != "cache_dir"}
    if unknown := sorted(params.keys() - accepted.keys()):
        raise ValueError(f"data.sources.{name} (name {kind}) does not take {unknown}; it takes "
                         f"{sorted([*accepted, *_OWN])}")
    required = [p.name for p in inspect.signature(loader).parameters.values()
                if p.kind.name == "KEYWORD_ONLY" and p.default is inspect.Parameter.empty and p.name != "cache_dir"]
    if missing := [k for k in required if params.get(k) in (None, "???")]:
        raise ValueError(f"data.sources.{name} (name {kind}) needs {missing}; it takes {sorted([*accepted, *_OWN])}")
    check_values(f"data.sources.{name}.", params, accepted)
    return Source(name, kind, weight, params)


def shares(weights: list[float], chunk: int = CHUNK) -> list[int]:
    """The blocks of each source in a chunk: chunk · w_s / Σw rounded by largest remainder (Hamilton's method: the
    floors, then one more to the largest remainders, the first source first among equal ones); they sum to `chunk`."""
    total = sum(weights)
    quotas = [chunk * w / total for w in weights]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(weights)), key=lambda s: (counts[s] - quotas[s], s))
    for s in by_remainder[: chunk - sum(counts)]:
        counts[s] += 1
    return counts


def open_source(source: Source, cache_dir: Path) -> Any:
    """The source's corpus (a FileSource, DatasetSource or BinSource), its errors naming the source's own keys
    (`data.paths` of text_files' message is `data.sources.<name>.paths` here)."""
    try:
        return KINDS[source.kind](**source.params, cache_dir=cache_dir)
    except (FileNotFoundError, ValueError, RuntimeError) as err:
        kind = next(c for c in (FileNotFoundError, ValueError, RuntimeError) if isinstance(err, c))
        raise kind(rekey(str(err), source.name)) from err


def rekey(message: str, name: str) -> str:
    """A corpus's message with its keys (`data.paths`) as the source's (`data.sources.<name>.paths`)."""
    return re.sub(r"(?<![\w.])data\.(?=[a-z_])", f"data.sources.{name}.", message)


def fingerprint(sources: list[Source]) -> str:
    """sha256 of the sources' names and kinds: which sources a run has (their data is each source's own record)."""
    return hashlib.sha256(json.dumps([[s.name, s.kind] for s in sources]).encode()).hexdigest()
