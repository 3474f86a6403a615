"""Token shards: a corpus tokenized once into flat uint16/uint32 files plus an index, then memory-mapped.

Layout, under `<cache_dir>/shards/<key>/` (the key hashes the corpus fingerprint and the tokenizer recipe):

    tokenizer.json            the tokenizer the shards were made with (the run directory gets a copy)
    shard-00000.bin ...       the token ids, native byte order, no header (np.memmap reads them)
    shard-00000.docs.npy      where each document ends in that shard (token offsets, end exclusive)
    shard-00000.json          written last: the shard is complete (a resumed preparation skips it)
    index.json                written last of all: the shards, in order, with their token counts

Invariants (tests/unit/data/test_shards.py checks each):
- The token stream is the documents' tokens in corpus order, each document followed by the end-of-document
  id when `eod` is set. Documents are cut into shards by characters read, never by process, so 1 and N
  processes, and a preparation resumed after a kill, write byte-identical shards.
- Memory is bounded whatever the corpus, its files' sizes and `num_proc`: documents arrive as pieces and a worker
  tokenizes and writes them `_ENCODE_CHARS` at a time, inside a document too (it holds its tokenizer and a few MB
  of text and ids); for files, the main process hands out names only (a dataset's rows: at most `2 × num_proc`
  shards' worth of text in flight); nothing ever holds the whole corpus. The data benchmark measures it (PSS by
  process and phase: `python -m lmlab.bench data`).
- One preparation per key: the directory's lock (`lmlab.record.rundir.RunLock`, waiting); a second job waits, then reads
  the index.
"""

from __future__ import annotations

import bisect
import hashlib
import io
import itertools
import json
import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from lmlab.record.rundir import RunLock, atomic_write

FORMAT = 1
_ENCODE_CHARS = 1 << 20  # characters per tokenizer call: bounds the tokenizer's own per-token objects
_PIECE_CHARS = 1 << 12  # a long document is fed to a (non-char) tokenizer in pieces of about this many characters:
# BPE encodes 4 K-character pieces 2-3x faster than 1 M-character ones (measured: 2.9 vs 1.0 MB/s)


# --- the token stream, as training reads it ---


class TokenStream:
    """The concatenation of memory-mapped shards, read by global token offset; `[a:b]` gives a view."""

    def __init__(self, arrays: list[np.ndarray], start: int = 0, stop: int | None = None) -> None:
        self.arrays = arrays
        self.offsets = np.cumsum([0] + [len(a) for a in arrays]).tolist()
        self.start, self.stop = start, self.offsets[-1] if stop is None else stop
        self.dtype = arrays[0].dtype if arrays else np.dtype("uint16")

    @classmethod
    def open(cls, directory: Path, index: dict[str, Any]) -> TokenStream:
        """The shards of `index`, each checked to hold the tokens the index gives it (a truncated or missing shard is
        refused with its path, not read past its end)."""
        dtype = np.dtype(index["dtype"])
        arrays = []
        for s in index["shards"]:
            path = directory / s["file"]
            size = path.stat().st_size if path.is_file() else None
            if size != s["tokens"] * dtype.itemsize:
                found = "is missing" if size is None else f"holds {size} bytes"
                raise ShardError(f"the token shard {path} {found}, but its index ({directory / 'index.json'}) gives "
                                 f"{s['tokens']} tokens of {dtype.itemsize} bytes; {_REBUILD.format(directory)}")
            if s["tokens"] > 0:
                arrays.append(np.memmap(path, dtype=dtype, mode="r", shape=(s["tokens"],)))
        return cls(arrays)

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> TokenStream:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("TokenStream takes contiguous slices; use read(a, b) for the tokens")
        a, b, _ = key.indices(len(self))
        return TokenStream(self.arrays, self.start + a, self.start + max(a, b))

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens [a, b) of this view (a zero-copy memmap slice when they lie in one shard)."""
        a, b = self.start + a, self.start + b
        i = bisect.bisect_right(self.offsets, a) - 1
        parts = []
        while a < b:
            take = min(b, self.offsets[i + 1]) - a
            parts.append(self.arrays[i][a - self.offsets[i]: a - self.offsets[i] + take])
            a, i = a + take, i + 1
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else np.empty(0, self.dtype)

    def release(self, a: int, b: int) -> None:
        """Drop this process's mapped pages of tokens [a, b) (they stay in the page cache): a pass over a whole corpus
        (the unigram count) then holds one chunk resident, not every shard it read (2 GB of RSS for 1e9 tokens, which
        a cluster's memory limit counts)."""
        import mmap

        a, b = self.start + a, self.start + b
        for i, array in enumerate(self.arrays):
            lo, hi = max(a, self.offsets[i]) - self.offsets[i], min(b, self.offsets[i + 1]) - self.offsets[i]
            handle = getattr(array, "_mmap", None)
            if hi <= lo or handle is None:
                continue
            start = lo * array.itemsize // mmap.PAGESIZE * mmap.PAGESIZE
            handle.madvise(mmap.MADV_DONTNEED, start, hi * array.itemsize - start)

    def chunks(self, size: int = 1 << 24) -> Iterator[np.ndarray]:
        for a in range(0, len(self), size):
            yield self.read(a, min(a + size, len(self)))

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.read(0, len(self))
        return out if dtype is None else out.astype(dtype)


class BlockView:
    """Non-overlapping blocks of a stream, shape (n, block): row i is tokens [i·block, (i+1)·block)."""

    def __init__(self, stream: TokenStream, block: int, n: int | None = None) -> None:
        self.stream, self.block = stream, block
        self.n = len(stream) // block if n is None else n

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.block)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: int | slice) -> Any:
        if isinstance(key, slice):
            a, b, step = key.indices(self.n)
            if step != 1:
                raise TypeError("BlockView takes contiguous slices")
            return BlockView(self.stream[a * self.block:], self.block, max(0, b - a))
        if not -self.n <= key < self.n:
            raise IndexError(f"block {key} of {self.n}")
        key %= self.n
        return self.stream.read(key * self.block, (key + 1) * self.block)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = self.stream.read(0, self.n * self.block).reshape(self.n, self.block)
        return out if dtype is None else out.astype(dtype)

    def target_counts(self, vocab_size: int, rows: int = 1 << 16) -> np.ndarray:
        """Counts of every token id among the targets (each row but its first token), in chunks of rows, each counted
        ~1 M tokens at a time (bincount's int64 copy of a whole chunk was 80 MB at 129 tokens a row). Smaller chunks
        would leave more pages mapped: the kernel maps pages around each fault, some of them in chunks released
        before (2-MB chunks left 330 MB of a 2-GB stream)."""
        counts = np.zeros(vocab_size, dtype=np.int64)
        step = max(1, (1 << 20) // self.block)
        for r in range(0, self.n, rows):
            k = min(rows, self.n - r)
            chunk = self.stream.read(r * self.block, (r + k) * self.block).reshape(k, self.block)
            for s in range(0, k, step):
                counts += np.bincount(chunk[s: s + step, 1:].ravel(), minlength=vocab_size)[:vocab_size]
            self.stream.release(r * self.block, (r + k) * self.block)
        return counts


# --- preparation ---


def shard_key(**recipe: Any) -> str:
    return hashlib.sha256(json.dumps({"format": FORMAT, **recipe}, sort_keys=True).encode()).hexdigest()[:32]


class ShardError(ValueError):
    """A shard directory that does not hold what its index says, refused with the path and the fix."""


_REBUILD = "remove {0} (rm -r) and run again to prepare the shards anew"
_INDEX_KEYS = ("format", "dtype", "vocab_size", "eod_id", "shards", "tokens")


def read_index(directory: Path) -> dict[str, Any] | None:
    """The index of a finished preparation (None: not finished); a corrupt one is refused with its path."""
    path = directory / "index.json"
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
        missing = [k for k in _INDEX_KEYS if k not in index]
        if missing:
            raise ValueError(f"no {missing}")
        np.dtype(index["dtype"])
        for shard in index["shards"]:
            if not isinstance(shard["file"], str) or Path(shard["file"]).name != shard["file"] or \
                    not isinstance(shard["tokens"], int) or shard["tokens"] < 0:
                raise ValueError(f"a shard entry {shard!r:.80} that is not a file name and a token count")
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise ShardError(f"the shard index {path} is corrupt ({err}); {_REBUILD.format(directory)}") from None
    return index


def prepared(directory: Path, make: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """The index of the shards in `directory`, made by `make()` (which writes them and their index) unless a finished
    preparation is there; one job prepares them, under the directory's lock, and a second one waits, then reads."""
    index = read_index(directory)
    if index is None:
        with RunLock(directory, wait=True):
            if (index := read_index(directory)) is None:  # not made by the job we waited for
                index = make()
    return index


def write(directory: Path, units: Iterable[Any], *, corpus: str, recipe: dict[str, Any], eod: str | None,
          num_proc: int) -> dict[str, Any]:
    """Tokenize a corpus (`units`, as `tokenize` takes them) into shards in `directory` with the tokenizer.json the
    caller put there, then write the index (`corpus`: the corpus fingerprint; `recipe`: what else decides the ids, the
    directory's key) last; returns it. `eod`: the end-of-document token's text, appended to every document."""
    data = (directory / "tokenizer.json").read_bytes()
    tok = Tokenizer.from_str(data.decode())
    eod_id = None if eod is None else tok.token_to_id(eod)
    dtype = "uint16" if tok.get_vocab_size() <= 2**16 else "uint32"
    metas = tokenize(units, directory, tokenizer_json=tok.to_str(), eod_id=eod_id, dtype=dtype, num_proc=num_proc)
    index = {"format": FORMAT, "corpus": corpus, "recipe": recipe, "dtype": dtype, "vocab_size": tok.get_vocab_size(),
             "eod_id": eod_id, "shards": metas, "tokenizer_sha256": hashlib.sha256(data).hexdigest(),
             "tokens": sum(m["tokens"] for m in metas), "documents": sum(m["docs"] for m in metas)}
    atomic_write(directory / "index.json", json.dumps(index, indent=1))
    return index


def load_tokenizer(directory: Path, index: dict[str, Any]) -> Tokenizer:
    """The shards' tokenizer.json, checked against what the index recorded when the shards were made (its sha256, and
    its vocabulary size): a tokenizer replaced after the fact would decode the ids into other text."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise ShardError(f"{path} is missing beside the shards of {directory}; {_REBUILD.format(directory)}")
    data = path.read_bytes()
    recorded = index.get("tokenizer_sha256")  # absent in indexes lmlab wrote before December 2026: vocabulary only
    if recorded is not None and hashlib.sha256(data).hexdigest() != recorded:
        raise ShardError(f"{path} is not the tokenizer the shards were made with (its sha256 differs from the one in "
                         f"{directory / 'index.json'}); {_REBUILD.format(directory)}")
    tok = Tokenizer.from_str(data.decode())
    if tok.get_vocab_size() != index["vocab_size"]:
        raise ShardError(f"{path} has {tok.get_vocab_size()} tokens, the shards' index {index['vocab_size']}: not the "
                         f"tokenizer the shards were made with; {_REBUILD.format(directory)}")
    return tok


def safe_pieces(pieces: Iterable[str], size: int, anywhere: bool) -> Iterator[str]:
    """Re-cut a document's pieces to about `size` characters where tokenizing the parts equals tokenizing the whole.

    `anywhere` (char tokenizers): the pieces as they come. Otherwise a cut is made only after a newline with a
    non-space on both sides ("x\\n|y"): GPT-2-style pre-tokenizers never join a lone newline to either
    neighbour there, so no pre-token spans the cut. A document without such a place stays whole.
    """
    if anywhere:
        yield from pieces
        return
    buf = ""
    for piece in pieces:
        buf += piece
        while len(buf) > size and (cut := _safe_cut(buf, size)) > 0:
            yield buf[:cut]
            buf = buf[cut:]
    if buf:
        yield buf


def _safe_cut(text: str, start: int) -> int:
    """The first place at or after `start` just past a newline with non-space characters on both sides; -1 if none."""
    i = start - 1
    while (i := text.find("\n", max(i, 1))) != -1:
        if i + 1 < len(text) and not text[i - 1].isspace() and not text[i + 1].isspace():
            return i + 1
        i += 1
    return -1


class Encoder:
    """text -> ids as the tokenizer gives them; char tokenizers through a code-point table (same ids, no objects)."""

    def __init__(self, tokenizer_json: str) -> None:
        self.tok = Tokenizer.from_str(tokenizer_json)
        spec = json.loads(tokenizer_json)
        self.table: np.ndarray | None = None
        self.char = is_char_tokenizer(spec)  # cut documents anywhere: char ids never depend on the neighbours
        if self.char:  # every code point -> its id, <unk> for the rest: one gather per piece
            vocab = spec["model"]["vocab"]
            self.table = np.full(0x110000, vocab[spec["model"]["unk_token"]], dtype=np.uint32)
            chars = {ord(c): i for c, i in vocab.items() if len(c) == 1}
            self.table[list(chars)] = list(chars.values())

    def __call__(self, texts: list[str]) -> list[np.ndarray]:
        if self.table is not None:
            return [self.table[np.frombuffer(t.encode("utf-32-le"), dtype=np.uint32)] for t in texts]
        encode = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)  # _fast: no character offsets
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]


def is_char_tokenizer(spec: dict[str, Any]) -> bool:
    """lmlab's `char` tokenizer shape (also from a path): one token per code point, no added tokens, no normalizer."""
    pre = spec.get("pre_tokenizer") or {}
    return (spec.get("model", {}).get("type") == "WordLevel" and not spec.get("added_tokens")
            and spec.get("normalizer") is None and pre.get("type") == "Split"
            and pre.get("pattern", {}).get("Regex") == r"[\s\S]")


_worker: dict[str, Any] = {}


def _init_worker(tokenizer_json: str, eod_id: int | None, dtype: str, directory: str) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process = one core: num_proc says how many
    _worker.update(encode=Encoder(tokenizer_json), eod=eod_id, dtype=np.dtype(dtype), dir=Path(directory))


def _write_shard(k: int, unit: Any) -> dict[str, int]:
    """Tokenize one unit's documents into shard k, written as it goes (memory stays flat whatever the unit's size);
    the .json sidecar last, so a shard killed half-way is redone."""
    encode, eod, dtype, directory = _worker["encode"], _worker["eod"], _worker["dtype"], _worker["dir"]
    name = f"shard-{k:05d}"
    doc_ends: list[int] = []
    n = 0
    batch: list[tuple[str, bool]] = []
    tmp = directory / f".{name}.bin.{os.getpid()}.tmp"
    with open(tmp, "wb") as out:

        def flush() -> None:
            nonlocal n
            for ids, (_, ends) in zip(encode([t for t, _ in batch]), batch, strict=True):
                out.write(ids.astype(dtype, copy=False).data)
                n += len(ids)
                if ends:
                    if eod is not None:
                        out.write(np.array([eod], dtype=dtype).data)
                        n += 1
                    doc_ends.append(n)
            batch.clear()

        chars = 0  # in the batch

        def add(text: str, ends: bool) -> None:
            """Queue a piece (`ends`: its document's last); tokenize and write the queue once it holds `_ENCODE_CHARS`
            characters, inside a document too: a worker holds no more text and ids than that, whatever the document."""
            nonlocal chars
            batch.append((text, ends))
            chars += len(text)
            if chars >= _ENCODE_CHARS:
                flush()
                chars = 0

        for doc in unit.documents():
            pieces = safe_pieces(doc, _PIECE_CHARS, encode.char)
            previous = next(pieces, "")
            for piece in pieces:
                add(previous, False)
                previous = piece
            add(previous, True)
        flush()
    os.replace(tmp, directory / f"{name}.bin")
    ends = io.BytesIO()
    np.save(ends, np.asarray(doc_ends, dtype=np.int64))
    atomic_write(directory / f"{name}.docs.npy", ends.getvalue())
    meta = {"file": f"{name}.bin", "tokens": n, "docs": len(doc_ends)}
    atomic_write(directory / f"{name}.json", json.dumps(meta))
    return meta


def tokenize(units: Iterable[Any], directory: Path, *, tokenizer_json: str, eod_id: int | None,
             dtype: str, num_proc: int) -> list[dict[str, int]]:
    """Write one shard per unit of the corpus (`units`: objects with `documents()` and `describe()`, made by the
    corpus source independently of `num_proc`) into `directory`, in `num_proc` processes; the shards' metadata, in
    order.

    Shards complete from an earlier, interrupted attempt (their .json exists) are not tokenized again. A worker that
    dies (killed, out of memory) or raises ends the preparation with `ShardError` naming the shard and its text,
    never a hang: a process pool that knows it is broken (concurrent.futures), not multiprocessing.Pool, which
    loses a dead worker's task and waits for it forever.
    """
    init = (tokenizer_json, eod_id, dtype, str(directory))
    for stale in directory.glob(".shard-*.tmp"):  # a shard an interrupted attempt was writing (we hold the lock)
        stale.unlink(missing_ok=True)
    metas: list[dict[str, int] | None] = []
    todo = _pending(units, directory, metas)
    head = list(itertools.islice(todo, 2))
    todo = itertools.chain(head, todo)
    if num_proc <= 1 or len(head) < 2:  # one shard to write (small corpora): no processes to start
        _init_worker(*init)
        for k, unit in todo:
            metas[k] = _write_shard(k, unit)
        return metas  # type: ignore[return-value]
    # forkserver: workers start from a clean process (no torch, no threads of the parent's) and import only this module
    # (not preloaded in the forkserver: its workers would share those ~15 MB, but it would keep them for the whole run)
    ctx = multiprocessing.get_context("forkserver")
    pool = ProcessPoolExecutor(num_proc, mp_context=ctx, initializer=_init_worker, initargs=init)
    in_flight: deque[tuple[int, Any, Future]] = deque()
    try:
        for k, unit in todo:
            in_flight.append((k, unit, pool.submit(_write_shard, k, unit)))
            while len(in_flight) >= 2 * num_proc:  # bounded read-ahead: memory stays flat whatever the corpus
                _collect(in_flight.popleft(), metas, directory)
        while in_flight:
            _collect(in_flight.popleft(), metas, directory)
    except BaseException:  # an error, or a signal before training (lmlab.run.interrupt): stop the workers now
        for process in list(getattr(pool, "_processes", {}).values()):
            process.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return metas  # type: ignore[return-value]


def _collect(item: tuple[int, Any, Future], metas: list[dict[str, int] | None], directory: Path) -> None:
    k, unit, future = item
    try:
        metas[k] = future.result()
    except BrokenProcessPool:
        raise ShardError(f"a tokenizing process died while the shards of {directory} from shard {k} on were being "
                         f"written (shard {k}: {unit.describe()}): killed, or out of memory? Lower data.num_proc or "
                         f"data.shard_size; the shards already written are kept and the next run goes on from "
                         f"them") from None
    except Exception as err:
        raise ShardError(f"shard {k} of {directory} ({unit.describe()}) failed: {type(err).__name__}: {err}") from err


def _pending(units: Iterable[Any], directory: Path, metas: list[dict[str, int] | None]) -> Iterator[tuple[int, Any]]:
    """(k, unit) of each shard still to write; `metas` gets every shard's metadata slot as the units go by, filled
    from its .json sidecar when an earlier attempt completed it."""
    for k, unit in enumerate(units):
        sidecar = directory / f"shard-{k:05d}.json"
        metas.append(json.loads(sidecar.read_text()) if sidecar.is_file() else None)
        if metas[k] is None:
            yield k, unit
