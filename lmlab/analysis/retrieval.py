"""Retrieval across lengths: can a trained LM find a fact planted in its context? RULER's simplest families
(Hsieh et al., 2024) and the needle-in-a-haystack test, built from the run's own validation text and tokenizer:

- `passkey`: one fact, " The pass key of <key> is <value>. ", planted at a relative depth d of a stretch of
  validation text; at the end the question " The pass key of <key> is " and the model must continue with <value>;
- `multikey`: `keys` such facts with distinct keys (the others at random depths: distractors), the one asked at d.
Keys are 4 and values 5 random lowercase letters, encoded with the run's tokenizer piece by piece (the fact's words,
the key, the value), so the answer's tokens are the same wherever it appears. A prompt is scored by exact match: the
model's greedy choice at every answer token, given the ones before (teacher forcing: what greedy decoding writes when
it is right so far), equals the value's tokens. An untrained model scores about 0 (its chance of 5 letters in a row),
a model that copies from its context about 1.

`eval.py run=<dir> retrieval=passkey|multikey [lengths=[...]] [depths=[...]] [retrieval_samples=32]
[retrieval_keys=4]` writes <run>/eval_retrieval/retrieval.{json,md}: accuracy per length × depth; `eval.py
compare=<sweep>` tabulates each run's accuracy per length beside the others (the section below).
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from lmlab.analysis.sections import Sweep, section
from lmlab.record.tables import write_table

Family = Literal["passkey", "multikey"]
KEY_LETTERS, VALUE_LETTERS = 4, 5
FACT, IS, END = " The pass key of ", " is ", ". "
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
FILE = Path("eval_retrieval") / "retrieval.json"


@dataclass(frozen=True)
class Prompt:
    """Token ids of one task: `tokens` (length + 1: the context, the question, the answer) and the answer's span at
    the end (`answer` tokens)."""

    tokens: list[int]
    answer: int


def _word(rng: np.random.Generator, n: int) -> str:
    return "".join(rng.choice(list(string.ascii_lowercase), n))


def prompts(encode: Callable[[str], list[int]], text: np.ndarray, length: int, depth: float, family: Family,
            n: int, seed: int = 0, keys: int = 4) -> list[Prompt]:
    """`n` prompts of `length` context tokens (the fact(s) inside a stretch of `text`, the validation tokens, then
    the question; the answer after), the asked fact at relative depth `depth` of the text before the question."""
    rng = np.random.default_rng([seed, length, round(depth * 1000), keys if family == "multikey" else 1])
    fact, is_, end = encode(FACT), encode(IS), encode(END)
    out = []
    for _ in range(n):
        names = []
        while len(names) < (keys if family == "multikey" else 1):
            if (name := _word(rng, KEY_LETTERS)) not in names:
                names.append(name)
        facts = [(encode(name), encode(_word(rng, VALUE_LETTERS))) for name in names]
        key, value = facts[0]  # the one asked
        question = fact + key + is_
        planted = [fact + k + is_ + v + end for k, v in facts]
        filler = length + 1 - len(question) - len(value) - sum(map(len, planted))
        if filler < 0:
            raise ValueError(f"retrieval at length {length}: the facts, the question and the answer take "
                             f"{length + 1 - filler} tokens; use lengths >= {length - filler}")
        start = int(rng.integers(0, len(text) - filler)) if len(text) > filler else 0
        hay = [int(t) for t in text[start:start + filler]]
        if len(hay) < filler:
            raise ValueError(f"retrieval at length {length}: the validation text holds {len(text)} tokens, fewer "
                             f"than the {filler} of filler a prompt needs; use shorter lengths")
        at = [round(depth * filler)] + [int(rng.integers(0, filler + 1)) for _ in planted[1:]]
        tokens: list[int] = []
        last = 0
        for pos, piece in sorted(zip(at, planted, strict=True), key=lambda pair: pair[0]):
            tokens += hay[last:pos] + piece
            last = pos
        tokens += hay[last:] + question + value
        out.append(Prompt(tokens, len(value)))
    return out


@torch.no_grad()
def exact_match(model: torch.nn.Module, batch: Sequence[Prompt], batch_size: int = 8) -> list[bool]:
    """Whether the model's greedy token at each answer position (teacher-forced) is the answer's, for every prompt."""
    hits = []
    for i in range(0, len(batch), batch_size):
        chunk = batch[i:i + batch_size]
        tokens = torch.tensor([p.tokens for p in chunk])
        logits = model(tokens[:, :-1])  # (B, length, V)
        guess = logits.argmax(-1)
        for row, p in enumerate(chunk):
            hits.append(bool((guess[row, -p.answer:] == tokens[row, -p.answer:]).all()))
    return hits


def retrieval(model: torch.nn.Module, encode: Callable[[str], list[int]], text: np.ndarray, lengths: Sequence[int],
              family: Family = "passkey", depths: Sequence[float] = DEFAULT_DEPTHS, samples: int = 32,
              keys: int = 4, seed: int = 0, batch_size: int = 8) -> list[dict[str, Any]]:
    """Accuracy (exact match) per length and depth: one row each."""
    rows = []
    for length in lengths:
        for depth in depths:
            hits = exact_match(model, prompts(encode, text, length, depth, family, samples, seed, keys), batch_size)
            rows.append({"family": family, "length": length, "depth": depth, "keys": keys if family == "multikey"
                         else 1, "accuracy": sum(hits) / len(hits), "n": len(hits)})
    return rows


def run_retrieval(run_dir: str | Path, family: str, lengths: Sequence[int] | None = None,
                  depths: Sequence[float] | None = None, samples: int = 32, keys: int = 4, batch_size: int = 8,
                  allow_extrapolation: bool = False, out: Path | None = None) -> tuple[list[dict[str, Any]], str]:
    """eval.py's retrieval=: the run's last checkpoint on prompts from its validation text, at `lengths` (default:
    the trained length; past it with allow_extrapolation=true, the model run at the longer length as eval.py's
    length sweep runs it); writes retrieval.{json,md} into `out` (default <run>/eval_retrieval)."""
    from lmlab.analysis.evaluate import check_reach, extension_model, run_data
    from lmlab.data.tokenizer import load_tokenizer
    from lmlab.record.rundir import load_run

    depths = list(DEFAULT_DEPTHS if depths is None else depths)
    check_args(family, depths, samples, keys if family == "multikey" else 2)
    run_dir = Path(run_dir)
    saved = load_run(run_dir)
    trained = saved.model.get("train_len") or saved.model["max_seq_len"]
    lengths = sorted(set(lengths or [trained]))
    for length in lengths:
        check_reach(saved.model["position"]["name"], "none", length, trained, allow_extrapolation)
    tok = load_tokenizer(run_dir / "tokenizer.json", saved.model["vocab_size"])
    text = np.asarray(run_data(run_dir, saved.config, seq_len=trained).val_tokens)
    rows = []
    for length in lengths:
        model = extension_model(saved.model, saved.weights, length, None)
        rows += retrieval(model, lambda s: tok.encode(s).ids, text, [length], family, depths, samples, keys,
                          batch_size=batch_size)
    return rows, write(rows, str(run_dir), out or run_dir / FILE.parent)


def check_args(family: str, depths: Sequence[float], samples: int, keys: int) -> None:
    """Refuse, naming the eval.py key, what retrieval cannot run with."""
    if family not in ("passkey", "multikey"):
        raise ValueError(f"retrieval={family!r} is not a task; choose passkey or multikey")
    if bad := [d for d in depths if isinstance(d, bool) or not isinstance(d, int | float) or not 0 <= d <= 1]:
        raise ValueError(f"depths={list(depths)}: {bad} are not relative depths in [0, 1]")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"retrieval_samples={samples!r} must be an integer >= 1")
    if isinstance(keys, bool) or not isinstance(keys, int) or keys < 2:
        raise ValueError(f"retrieval_keys={keys!r} must be an integer >= 2 (the facts of retrieval=multikey)")


def write(rows: list[dict[str, Any]], run: str, out: Path) -> str:
    """retrieval.json and retrieval.md in `out`; returns the markdown: accuracy, a row per length, a column per
    depth."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "retrieval.json").write_text(json.dumps({"run": run, "rows": rows}, indent=2))
    depths = sorted({r["depth"] for r in rows})
    lines = [f"| length | {' | '.join(f'depth {d:g}' for d in depths)} | mean |",
             "|---|" + "---|" * (len(depths) + 1)]
    for length in sorted({r["length"] for r in rows}):
        acc = [r["accuracy"] for d in depths for r in rows if r["length"] == length and r["depth"] == d]
        lines.append(f"| {length} | {' | '.join(f'{a:.2f}' for a in acc)} | {sum(acc) / len(acc):.2f} |")
    family = rows[0]["family"] + (f" ({rows[0]['keys']} keys)" if rows[0]["family"] == "multikey" else "")
    md = f"Retrieval, {family}: exact-match accuracy over {rows[0]['n']} prompts per cell\n\n" + "\n".join(lines)
    (out / "retrieval.md").write_text(md + "\n")
    return md


@section(35)
def retrieval_section(sweep: Sweep) -> str:
    """Each run's retrieval accuracy per length (mean over depths), from its eval_retrieval/retrieval.json; empty
    when no run of the sweep has one."""
    from lmlab.record.rundir import read_json

    found = {run: read_json(run / FILE)["rows"] for run in sweep.runs if (run / FILE).is_file()}
    if not found:
        return ""
    lengths = sorted({r["length"] for rows in found.values() for r in rows})
    by = sweep.variant_keys or ["run"]
    table = []
    for run, rows in found.items():
        row: dict[str, Any] = {"variant": sweep.name(run, by), "family": rows[0]["family"]}
        for length in lengths:
            acc = [r["accuracy"] for r in rows if r["length"] == length]
            row[f"acc@{length}"] = round(sum(acc) / len(acc), 3) if acc else None
        table.append(row)
    cols = ["variant", "family", *(f"acc@{n}" for n in lengths)]
    return ("\nRetrieval (eval.py run=<run> retrieval=...): exact-match accuracy per length, the mean over depths\n\n"
            + write_table(table, cols, sweep.dir / "compare_retrieval"))
