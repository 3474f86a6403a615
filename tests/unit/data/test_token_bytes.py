"""The bytes per token table behind bits per byte (lmlab.data.token_bytes), on hand-picked strings: each id's entry is
the UTF-8 bytes of text it stands for, so the table summed over a text's tokens is the text's byte count, whatever the
tokenizer (char, byte-level BPE with merges, bytes alone). A byte-level token holding part of a character counts its
raw bytes, not the 3 bytes of the U+FFFD its own decoding shows; an end-of-document token stands for no text."""

from __future__ import annotations

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from lmlab.data.token_bin import stand_in_tokenizer
from lmlab.data.token_bytes import token_bytes
from lmlab.data.tokenizer import train_bpe, train_char

EOD = "<|endoftext|>"
TEXTS = ["the king é and the queen € said 😀 naïve", "größe señor 日本 café\n", "😀😀 the end\n"]


def _bytes(tok: Tokenizer, table: np.ndarray, text: str) -> int:
    return int(table[tok.encode(text).ids].sum())


def _byte_tokenizer() -> Tokenizer:
    """The bytes alone: one token per byte (a byte-level BPE with no merges), GPT-2's byte-to-character alphabet."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_char_tokens_count_their_characters_utf8_bytes_and_eod_none() -> None:
    tok = train_char(["aé€😀\n"], vocab_size=0, eod=EOD)
    vocab = tok.get_vocab()
    eod, unk = vocab[EOD], vocab["<unk>"]
    table = token_bytes(tok, 12, eod_id=eod)
    assert table.shape == (12,) and table.dtype == np.int64
    assert {c: int(table[vocab[c]]) for c in "aé€😀\n"} == {"a": 1, "é": 2, "€": 3, "😀": 4, "\n": 1}
    assert table[eod] == 0  # a plain vocab entry of the char tokenizer: only the eod id says it is the EOD token
    assert table[unk] == 1  # an unseen character: one byte at least (bits per byte errs high, never flatters)
    assert (table[len(vocab):] == 0).all()  # ids past the tokenizer's (a padded vocabulary, [MASK])
    assert _bytes(tok, table, "é😀a\n€") == len("é😀a\n€".encode())


def test_a_character_split_across_byte_tokens_counts_its_raw_bytes() -> None:
    """The field's byte-count bug: decoding each token alone turns a partial character into U+FFFD (3 bytes)."""
    tok = _byte_tokenizer()
    table = token_bytes(tok, 256)
    ids = tok.encode("😀").ids
    assert len(ids) == 4 and all(tok.decode([i]) == "\ufffd" for i in ids)  # each a quarter of the emoji
    assert [int(table[i]) for i in ids] == [1, 1, 1, 1]
    assert sum(len(tok.decode([i]).encode()) for i in ids) == 12  # what the bug would count
    assert (table == 1).all()
    for text in TEXTS:
        assert _bytes(tok, table, text) == len(text.encode())


def test_merged_byte_level_bpe_tokens_and_a_special_eod() -> None:
    tok = train_bpe(TEXTS * 20, vocab_size=300, eod=EOD)
    eod = tok.token_to_id(EOD)
    table = token_bytes(tok, tok.get_vocab_size() + 3, eod_id=eod)
    assert table[eod] == 0 and (table[tok.get_vocab_size():] == 0).all()
    seen_partial = seen_merged = False
    for text in TEXTS:
        ids = tok.encode(text).ids
        seen_partial |= any("\ufffd" in tok.decode([i]) for i in ids)
        seen_merged |= any(table[i] > 1 and "\ufffd" not in tok.decode([i]) for i in ids)
        assert _bytes(tok, table, text) == len(text.encode())
        assert int(table[[*ids, eod]].sum()) == len(text.encode())  # a document and its end: its own bytes
    assert seen_partial and seen_merged  # the strings exercise both: part of a character, several characters
    assert table[tok.token_to_id("Ġthe")] == 4  # " the"
    # the same table whether the eod id is given or not: the tokenizer marks it special
    assert (token_bytes(tok, tok.get_vocab_size()) == table[: tok.get_vocab_size()]).all()


def test_a_tokenizer_whose_tokens_are_not_text_has_no_table() -> None:
    assert token_bytes(stand_in_tokenizer(50), 50) is None  # data=token_bin's stand-in: "<i>" is only a label
    words = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()  # the synthetic tasks' word tokenizers: spaces dropped
    assert token_bytes(words, 3) is None


def test_a_table_smaller_than_the_tokenizer_is_refused() -> None:
    tok = train_char(["abc"], vocab_size=0)
    with pytest.raises(ValueError, match="vocab"):
        token_bytes(tok, 2)
