"""Tokenizers: every one is a `tokenizers.Tokenizer`, so a run directory always holds one `tokenizer.json`.

`data.tokenizer` is `char`, `bpe` or a path to an existing `tokenizer.json`. Trained tokenizers are
cached under `<cache_dir>/tokenizers/` by (content hash of the training text, kind, vocab size), so a
sweep trains each one once and every run of it sees byte-identical files.

Both trained kinds decode exactly: `decode(encode(s).ids) == s` for any `s` made of characters seen in
training (char) or for any string at all (bpe, which works on bytes). No normalizer and no special
tokens are used, because either would break that.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from lmlab.data.corpus import fingerprint
from lmlab.data.shards import safe_pieces
from lmlab.record.rundir import temporary

UNK = "<unk>"
_READ = 1 << 20  # bytes of a Sample read at once


class Sample:
    """The documents a tokenizer learns from, spooled to a UTF-8 file (`ends`: the byte offset where each ends) and read
    back a piece at a time: `build_tokenizer` takes it for the list of their texts (the same fingerprint, the same
    tokenizer) in memory that does not grow with it. Iterating gives the documents' text in pieces of about a MB, cut
    anywhere for char tokenizers, otherwise only where tokenizing the parts equals tokenizing the whole
    (`shards.safe_pieces`: BPE learns the same merges from such pieces as from the whole documents)."""

    def __init__(self, path: str | Path, ends: Sequence[int], anywhere: bool) -> None:
        self.path, self.ends, self.anywhere = Path(path), ends, anywhere

    def __len__(self) -> int:
        return len(self.ends)

    def _spans(self) -> Iterator[tuple[int, int]]:
        a = 0
        for b in self.ends:
            yield a, b
            a = b

    def _documents(self) -> Iterator[tuple[int, Iterator[bytes]]]:
        """(size, its bytes a MB at a time) of each document, in order."""
        with open(self.path, "rb") as f:

            def read(a: int, b: int) -> Iterator[bytes]:
                while a < b:
                    f.seek(a)
                    if not (data := f.read(min(_READ, b - a))):
                        raise EOFError(f"{self.path} ends at byte {a}, before its sample's {self.ends[-1]} bytes")
                    a += len(data)
                    yield data

            for a, b in self._spans():
                yield b - a, read(a, b)

    def fingerprint(self) -> str:
        """`corpus.fingerprint` of the documents' texts, from their bytes."""
        h = hashlib.sha256()
        for size, doc in self._documents():
            h.update(size.to_bytes(8, "little"))
            for data in doc:
                h.update(data)
        return h.hexdigest()

    def documents(self) -> Iterator[Iterator[str]]:
        return (codecs.iterdecode(doc, "utf-8") for _, doc in self._documents())

    def texts(self) -> list[str]:
        """The documents whole (small samples: tests)."""
        return ["".join(doc) for doc in self.documents()]

    def __iter__(self) -> Iterator[str]:
        for doc in self.documents():
            yield from safe_pieces(doc, _READ, self.anywhere)


def train_char(texts: Iterable[str], *, vocab_size: int, eod: str | None = None) -> Tokenizer:
    """One token per Unicode character; vocab = the sorted characters of the training text, then `<unk>`
    (then the end-of-document token, when `eod` is set).

    `vocab_size` is ignored: the text decides it. Characters first seen in validation map to `<unk>`.
    `<unk>` and `eod` are plain vocab entries, not added tokens, so a literal "<unk>" in the text still
    encodes character by character, and the end-of-document id appears only where lmlab puts it.
    """
    chars = _distinct_chars(texts)
    vocab = {c: i for i, c in enumerate(chars)} | {UNK: len(chars)}
    if eod is not None:
        vocab[eod] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    # Oniguruma has no (?s) flag; [\s\S] is "any code point, newline included" in every regex dialect.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return tok


def _distinct_chars(texts: Iterable[str], chunk: int = 1 << 20) -> list[str]:
    """The sorted distinct characters of `texts`: code points counted with numpy, a chunk at a time (ten times
    faster than Python sets on a 100 M-character sample; the same result)."""
    seen = np.zeros(0x110000, dtype=bool)
    try:
        for text in texts:
            for a in range(0, len(text), chunk):
                seen[np.frombuffer(text[a: a + chunk].encode("utf-32-le"), dtype=np.uint32)] = True
    except UnicodeEncodeError:  # a lone surrogate (text decoded with surrogateescape): Python's sets take it
        return sorted(set().union(*map(set, texts)))
    return [chr(c) for c in np.flatnonzero(seen)]


def train_bpe(texts: list[str] | Sample, *, vocab_size: int, eod: str | None = None) -> Tokenizer:
    """Byte-level BPE (GPT-2 style): never produces `<unk>`, so any text round-trips exactly.

    `eod` becomes a special token inside `vocab_size` (as GPT-2's <|endoftext|>): like GPT-2's, a literal
    occurrence of it in a document is read as the end-of-document token.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=[eod] if eod is not None else [])
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    return tok


def _tokenizer_path(path: str | Path) -> Path:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data.tokenizer: {str(path)!r} does not exist (expected a tokenizer.json)")
    return path


def load_tokenizer(path: str | Path, vocab_size: int | None = None) -> Tokenizer:
    """A saved `tokenizer.json` (from `data.tokenizer=path`, a run directory, or the cache); one that cannot be read
    is refused naming the path, and with `vocab_size` (the model's) one whose ids reach past the model's vocabulary
    (a tokenizer.json from another run) naming both sizes."""
    path = _tokenizer_path(path)
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as err:  # noqa: BLE001  (the tokenizers library's own error, of its own type)
        raise ValueError(f"{path}: not a tokenizer.json the tokenizers library reads "
                         f"({' '.join(str(err).split())[:200]})") from None
    size = tok.get_vocab_size(with_added_tokens=True)
    if vocab_size is not None and size > vocab_size:
        raise ValueError(f"{path}: the tokenizer has {size:,} ids and the model's vocabulary {vocab_size:,}: ids "
                         f"past it have no embedding (is this tokenizer.json the run's own?)")
    return tok


def save_tokenizer(tok: Tokenizer, path: str | Path) -> None:
    """Write atomically: ranks and sweep jobs may write the same file at once, and none may read half of it."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(path)  # lmlab's own name, which RunDir.clean_temporaries removes after a kill
    tok.save(str(tmp))
    os.replace(tmp, path)


def check_tokenizer(kind: str, *, vocab_size: int) -> None:
    """Fail early on a `data.tokenizer` that is neither a known kind nor an existing tokenizer.json."""
    if kind == "bpe" and vocab_size <= 256:
        raise ValueError(f"data.vocab_size={vocab_size} must exceed 256 (the bytes) for data.tokenizer=bpe")
    if kind in TOKENIZERS:
        return
    if not (kind.endswith(".json") or os.sep in kind):
        raise ValueError(
            f"data.tokenizer={kind!r} is not an option; choose one of {sorted(TOKENIZERS)} or a tokenizer.json path"
        )
    _tokenizer_path(kind)


def build_tokenizer(kind: str, texts: list[str] | Sample, *, vocab_size: int, cache_dir: str | Path,
                    eod: str | None = None) -> Tokenizer:
    """Train `kind` on `texts` (or load it from the cache), or load `kind` itself if it is a tokenizer.json path.

    The returned tokenizer is always the one read back from disk, so its serialization (and hence
    every hash taken of it downstream) is the same on the first and on every later run. With `eod`, a
    loaded tokenizer that lacks that token gets it as a special token.
    """
    check_tokenizer(kind, vocab_size=vocab_size)
    if kind not in TOKENIZERS:
        tok = load_tokenizer(kind)
        if eod is not None and tok.token_to_id(eod) is None:
            tok.add_special_tokens([eod])
        return tok
    if kind == "char":
        vocab_size = 0  # not a parameter of char: keep it out of the cache key
    eod_key = "" if eod is None else f"-eod{hashlib.sha256(eod.encode()).hexdigest()[:8]}"
    digest = texts.fingerprint() if isinstance(texts, Sample) else fingerprint(texts)
    path = Path(cache_dir).expanduser() / "tokenizers" / f"{kind}-{vocab_size}{eod_key}-{digest[:20]}.json"
    if not path.is_file():
        if isinstance(texts, Sample) and kind != "char":
            _train_apart(kind, texts, vocab_size, eod, path)
        else:
            _train_and_save(kind, texts, vocab_size, eod, path)
    return Tokenizer.from_file(str(path))


def _train_and_save(kind: str, texts: list[str] | Sample, vocab_size: int, eod: str | None, path: str | Path) -> None:
    save_tokenizer(TOKENIZERS[kind](texts, vocab_size=vocab_size, eod=eod), path)


def _train_apart(kind: str, sample: Sample, vocab_size: int, eod: str | None, path: Path) -> None:
    """Train in a child process (a fresh interpreter: no torch, nothing of the caller's, no __main__ imported again)
    and save to `path`: the trainer's own memory (BPE's word and pair counts, ~450 MB on a 100 M-character sample),
    which the caller's allocator would otherwise keep to its end (train.py keeps freed memory), leaves with the child.
    The same tokenizer.json, byte for byte."""
    spec = json.dumps({"kind": kind, "path": str(sample.path), "ends": list(sample.ends), "anywhere": sample.anywhere,
                       "vocab_size": vocab_size, "eod": eod, "out": str(path)})
    from lmlab.env import child_python  # isolated from the working directory: nothing planted there is imported

    child = subprocess.Popen(child_python("from lmlab.data.tokenizer import _train_main; _train_main()"),
                             stdin=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _, err = child.communicate(spec)
    except BaseException:  # a signal before training (lmlab.run.interrupt): stop the child now
        child.kill()
        child.wait()
        raise
    if child.returncode != 0:
        raise RuntimeError(f"the process training the {kind} tokenizer ({path.name}) exited with {child.returncode} "
                           f"(killed, or out of memory? data.tokenizer_sample sets the characters it learns from): "
                           f"{err.strip()[-2000:]}")


def _train_main() -> None:
    """`_train_apart`'s child: the spec on stdin."""
    spec = json.loads(sys.stdin.read())
    sample = Sample(spec["path"], spec["ends"], spec["anywhere"])
    _train_and_save(spec["kind"], sample, spec["vocab_size"], spec["eod"], spec["out"])


TOKENIZERS: dict[str, Callable[..., Tokenizer]] = {"char": train_char, "bpe": train_bpe}
