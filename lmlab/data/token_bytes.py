"""Bytes per token: the denominator of bits per byte (`val/bpb`, `train/bpb`; lmlab.run.lit).

bits per byte = Σ nats over the target tokens / (ln 2 × the UTF-8 bytes of text those tokens stand for), the one loss
comparable across tokenizers and vocabularies (nanochat, parameter-golf, levanter score in it). The bytes are counted
per token from a table built once from the tokenizer, `token_bytes(tok, size)[id]`, and summed over a batch's targets
on the device (a gather: no host read). What each id counts, for the tokenizers lmlab trains and reads:

- byte-level BPE (`data.tokenizer=bpe`, GPT-2's tokenizer.json, the 256 bytes alone): the raw bytes it holds. Each
  character of a byte-level token's string is one byte (GPT-2's byte-to-character alphabet), so a token holding half
  of a multi-byte character counts its own bytes, not the 3 bytes of the U+FFFD its own decoding shows (the field's
  famous miscount);
- `char`: the UTF-8 bytes of its character; `<unk>` (a character first seen after training) counts 1 byte, a lower
  bound of any character's, so bits per byte errs high there, never in the model's favour;
- the end-of-document token (`data.eod`; token_bin's `data.doc_sep`) and every other special token: no bytes. lmlab's
  shards append it after each document (lmlab.data.shards): it stands for the boundary, not for text (a newline that
  ends a document is a token of its own); a non-special added token counts its content's bytes;
- ids past the tokenizer's (a vocabulary padded up, head=mlm's [MASK]): no bytes.

A tokenizer whose tokens are not pieces of the text has no table (None): data=token_bin's stand-in ("<i>" is only a
label), the synthetic tasks' word tokenizers (their decoding drops the spaces), any other tokenizer.json shape.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from lmlab.data.shards import is_char_tokenizer


def _byte_level(spec: dict[str, Any]) -> bool:
    """Whether the tokenizer decodes through GPT-2's byte-level alphabet (its tokens are strings of it)."""
    decoder = spec.get("decoder") or {}
    parts = (decoder.get("decoders") or []) if decoder.get("type") == "Sequence" else [decoder]
    return any(d.get("type") == "ByteLevel" for d in parts)


def _utf8(text: str) -> int:
    return len(text.encode("utf-8", "surrogateescape"))  # a byte that was not UTF-8 (read with surrogateescape): 1


def token_bytes(tokenizer: Any, size: int, eod_id: int | None = None) -> np.ndarray | None:
    """(size,) int64: the UTF-8 bytes of text each id stands for (module docstring), None when the tokenizer's tokens
    are not pieces of text. `size`: the model's vocabulary, at least the tokenizer's; `eod_id`: the data's
    end-of-document id (char keeps it as a plain vocabulary entry, which only this id marks)."""
    spec = json.loads(tokenizer.to_str())
    if _byte_level(spec):
        width = len  # one byte per character of the byte-level alphabet
    elif is_char_tokenizer({**spec, "added_tokens": []}):  # (a char tokenizer.json may have an eod added to it)
        width = _utf8
    else:
        return None
    if (n := tokenizer.get_vocab_size(with_added_tokens=True)) > size:
        raise ValueError(f"token_bytes: the tokenizer has {n:,} ids, more than the model's vocab of {size:,}")
    table = np.zeros(size, dtype=np.int64)
    for piece, i in tokenizer.get_vocab(with_added_tokens=False).items():
        table[i] = width(piece)
    unk = (spec.get("model") or {}).get("unk_token")
    if unk is not None and (i := tokenizer.token_to_id(unk)) is not None:
        table[i] = 1
    for added in spec.get("added_tokens") or []:
        table[added["id"]] = 0 if added.get("special") else _utf8(added["content"])
    if eod_id is not None:
        table[eod_id] = 0
    return table
