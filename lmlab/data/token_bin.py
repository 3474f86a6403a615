"""`data=token_bin`: pre-tokenized `.bin` shards in the nanoGPT / llm.c / modded-nanogpt layout, so a run reads the
same tokens as the speedrun and its numbers can be set beside the speedrun's.

A shard is a header of 256 little-endian int32 — [0] the magic 20240520, [1] the version 1, [2] the number of
tokens — then that many uint16 tokens (GPT-2 ids, < 65536). This is what llm.c's `dev/data/fineweb.py` and
modded-nanogpt's `data/cached_fineweb10B.py` write; a shard whose magic, version or length does not match is refused
with its path. Training reads the train shards (`data.train`, a glob) as one stream cut into blocks of
max_seq_len + 1, in a seeded order; validation is the first `data.val_tokens` tokens of the val shards (`data.val`,
a glob, in sorted order) — the speedrun's fixed 10,485,760-token protocol — not a fraction of the corpus.

The shards carry ids, not text: `data.tokenizer` is the tokenizer.json that made them (GPT-2's, for generate.py to
print text), or null for a stand-in whose token i is the text "<i>" (loss and eval need no text).

Documents (for attention.doc_mask and position.per_document): `data.doc_sep` is the id that separates them (GPT-2's
<|endoftext|>, 50256), null for none; `data.doc_sep_role` says whether it opens each document (`bos`: the speedrun's
shards, which llm.c and modded-nanogpt write as [50256, *document]) or ends each (`eod`: lmlab's own shards, a text
corpus's data.eod). The model records both (model.eod_id, model.doc_sep_role), so eval, generation and a resume
number the documents alike.

`data.align_docs=true` starts every training block at a document's first token (the speedrun's record 26, "align
training batch starts with EoS"): a block starts at a separator under `bos` (just after one under `eod`), and the next
block at the first document start at least max_seq_len tokens further on, so blocks do not overlap (but for the
last target, which may be the next block's first token) and the fewest tokens are skipped. Validation keeps the
fixed, unaligned blocks (as the record kept its validation).
"""

from __future__ import annotations

import glob
import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import DataLoader

from lmlab.data.datamodule import Blocks, StepSampler, TrainBlocks, pack, scheduled, scheduled_loader
from lmlab.data.shards import TokenStream
from lmlab.record.rundir import atomic_write, remember
from lmlab.registry import NonNegativeInt, check_values

log = logging.getLogger(__name__)

NAME = "token_bin"
MAGIC, VERSION, HEADER_INTS = 20240520, 1, 256
HEADER_BYTES = HEADER_INTS * 4
SPEEDRUN_VAL_TOKENS = 10_485_760
UNIGRAM_SAMPLE = 10_000_000  # train tokens the unigram plateau is counted on (a 10B-token corpus: a sample)
_KEYS = {"name", "train", "val", "val_tokens", "vocab_size", "tokenizer", "batch_size", "num_workers", "doc_sep",
         "doc_sep_role", "align_docs", "batch_schedule", "seq_schedule", "batch_lr_power"}
DOC_KEYS = {"doc_sep": NonNegativeInt | None, "doc_sep_role": Literal["bos", "eod"]}


class TokenBinError(ValueError):
    """A .bin shard that is not in the layout, named by its path."""


def write_shard(path: str | Path, tokens: Sequence[int] | np.ndarray) -> Path:
    """Write `tokens` as a .bin shard (header, then uint16), as llm.c's write_datafile does."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError("a .bin shard holds uint16 tokens: ids must be in [0, 65536)")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = MAGIC, VERSION, tokens.size
    atomic_write(Path(path), header.tobytes() + tokens.astype("<u2").tobytes())
    return Path(path)


def read_header(path: str | Path) -> int:
    """The number of tokens of the shard at `path`, after checking its magic, version and length."""
    path = Path(path)
    size = path.stat().st_size
    if size < HEADER_BYTES:
        raise TokenBinError(f"{path}: truncated .bin shard ({size} bytes, less than the {HEADER_BYTES}-byte header)")
    header = np.fromfile(path, dtype="<i4", count=HEADER_INTS)
    if header[0] != MAGIC:
        raise TokenBinError(f"{path}: magic number {header[0]} is not {MAGIC}: not a nanoGPT/llm.c .bin token shard")
    if header[1] != VERSION:
        raise TokenBinError(f"{path}: .bin shard version {header[1]}; lmlab reads version {VERSION} (uint16 tokens)")
    n = int(header[2])
    if size != HEADER_BYTES + 2 * n:
        raise TokenBinError(f"{path}: truncated .bin shard: the header gives {n} tokens ({HEADER_BYTES + 2 * n} "
                            f"bytes), the file has {size} bytes")
    return n


def shard_paths(pattern: str, key: str) -> list[str]:
    """The shards matching `pattern`, in reading (sorted) order; `key` names the option."""
    paths = sorted(glob.glob(str(Path(pattern).expanduser())))
    if not paths:
        raise FileNotFoundError(f"{key}={pattern}: no .bin shard matches")
    return paths


def shard_facts(path: str | Path, cache_dir: Path) -> dict[str, Any]:
    """A shard's sha256 (of the whole file) and largest token id, from one chunked read, remembered under
    `<cache_dir>/token_bin_shards/` by its path, size, mtime, ctime and inode (as a text corpus's fingerprint is): a
    later start only reads `stat`, and a shard rewritten in place is read again."""
    import json

    path = Path(path).resolve()
    st = path.stat()
    meta = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
    memo = cache_dir / "token_bin_shards" / f"{hashlib.sha256(repr(meta).encode()).hexdigest()[:32]}.json"
    try:
        facts = json.loads(memo.read_text())
        return {"sha256": str(facts["sha256"]), "max": int(facts["max"])}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    n = read_header(path)
    content, top, chunk = hashlib.sha256(), -1, 1 << 24
    with open(path, "rb") as f:
        content.update(f.read(HEADER_BYTES))
        while block := f.read(2 * chunk):
            content.update(block)
            ids = np.frombuffer(block[: len(block) // 2 * 2], dtype="<u2")
            top = max(top, int(ids.max())) if len(ids) else top
    facts = {"sha256": content.hexdigest(), "max": top if n else -1}
    remember(memo, json.dumps({**facts, "path": str(path)}))
    return facts


def fingerprint(paths: Sequence[str], cache_dir: Path) -> str:
    """sha256 over the shards' contents in reading order (shard_facts): moving or renaming them keeps it; adding,
    removing, reordering or changing one does not."""
    h = hashlib.sha256()
    for path in paths:
        h.update(bytes.fromhex(shard_facts(path, cache_dir)["sha256"]))
    return h.hexdigest()


def check_ids(paths: Sequence[str], key: str, vocab_size: int, cache_dir: Path) -> None:
    """Refuse shards that hold an id >= `vocab_size`, naming the shard (every id: shard_facts' largest)."""
    for p in paths:
        if (top := shard_facts(p, cache_dir)["max"]) >= vocab_size:
            raise ValueError(f"{key}: {p} holds token id {top}, not below data.vocab_size={vocab_size}")


def open_shards(pattern: str, key: str) -> TokenStream:
    """The shards matching `pattern` (sorted), checked and memory-mapped as one stream; `key` names the option."""
    paths = shard_paths(pattern, key)
    arrays = []
    for p in paths:
        if Path(p).is_dir():
            raise TokenBinError(f"{key}={pattern} matches the directory {p}: the glob must match .bin shard files "
                                f"(e.g. {Path(p) / '*.bin'})")
        n = read_header(p)
        if n:
            arrays.append(np.memmap(p, dtype="<u2", mode="r", offset=HEADER_BYTES, shape=(n,)))
    if not arrays:
        raise ValueError(f"{key}={pattern}: the shards hold no tokens")
    return TokenStream(arrays)


def doc_starts(stream: TokenStream, sep: int, opens: bool, chunk: int = 1 << 24) -> np.ndarray:
    """The positions where documents start (int64, ascending): each separator (`opens`, BOS), or the token after each
    (EOD), read a chunk at a time."""
    found = []
    for a in range(0, len(stream), chunk):
        ids = stream.read(a, min(len(stream), a + chunk))
        found.append(np.flatnonzero(ids == sep).astype(np.int64) + a + (0 if opens else 1))
    starts = np.concatenate(found) if found else np.empty(0, dtype=np.int64)
    return starts[starts < len(stream)]


class AlignedBlocks:
    """Blocks of `block` tokens that each start at a document start (`data.align_docs`): the first start, then each
    time the first start at least block − 1 tokens after the one before (the record's rule: the next block starts
    where the last one's inputs end, or at the next document), while a whole block fits."""

    def __init__(self, stream: TokenStream, block: int, starts: np.ndarray) -> None:
        self.stream, self.block = stream, block
        chosen, i = [], 0
        last = len(stream) - block  # the last position a whole block starts at
        while i < len(starts) and starts[i] <= last:
            chosen.append(starts[i])
            i = int(np.searchsorted(starts, starts[i] + block - 1, side="left"))
        self.starts = np.asarray(chosen, dtype=np.int64)

    @property
    def shape(self) -> tuple[int, int]:
        return (len(self.starts), self.block)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, key: int) -> np.ndarray:
        a = int(self.starts[key])
        return self.stream.read(a, a + self.block)


def stand_in_tokenizer(vocab_size: int):
    """A tokenizer whose token i is the text "<i>": ids round-trip, text is only a label."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"<{i}>": i for i in range(vocab_size)}, unk_token="<0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tok


class TokenBinDataModule:
    """The data module of `data=token_bin` (the task protocol of lmlab.data.tasks: no callbacks or figures)."""

    trainer: Any = None  # the Lightning trainer while one runs this data (lmlab.run.lit_data): the step, the ranks
    evaluable = True
    eod_id: int | None = None  # the task protocol's (lmlab.data.tasks): None until the data gives one
    labels: list[str] | None = None  # a labelled set's (head=classify's); none here
    tokenizer: Any = None  # its tokenizer once it has one
    shards: Mapping[str, Any] = MappingProxyType({})  # what a resume checks (lmlab.run.plan.check_same_data)
    corpus_sha256: str | None = None  # a text corpus's fingerprint (the same check): none here

    def __init__(self, data: Mapping[str, Any], *, seq_len: int, seed: int) -> None:
        if unknown := sorted(set(data) - _KEYS):
            hint = " (its documents' separator is an id: data.doc_sep, data.doc_sep_role)" if "eod" in unknown else ""
            raise ValueError(f"data=token_bin does not take {['data.' + k for k in unknown]}{hint}; it takes "
                             f"{sorted('data.' + k for k in _KEYS - {'name'})}")
        self.train_pattern, self.val_pattern = data.get("train"), data.get("val")
        for key in ("train", "val"):
            if not data.get(key):
                raise ValueError(f"data.{key} is required with data=token_bin: a glob of .bin shards")
        val_tokens = data.get("val_tokens")  # null: the speedrun's; 0 is refused below, not taken as the default
        self.val_tokens_n = SPEEDRUN_VAL_TOKENS if val_tokens is None else int(val_tokens)
        self.vocab_size = int(data.get("vocab_size") or 50257)
        self.tokenizer_kind = str(data.get("tokenizer") or NAME)
        self.batch_size, self.num_workers = int(data.get("batch_size", 8)), int(data.get("num_workers", 0))
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.batch_stages = scheduled(dict(data), self.seq_len)  # data.batch_schedule (lmlab.data.stages)
        self.cache_dir = Path(data.get("cache_dir") or os.environ.get("LMLAB_CACHE", "~/.cache/lmlab")).expanduser()
        if not 0 < self.vocab_size <= 2**16:
            raise ValueError(f"data.vocab_size={self.vocab_size} must be in [1, 65536]: .bin shards hold uint16 ids")
        if self.val_tokens_n < self.seq_len + 1:
            raise ValueError(f"data.val_tokens={self.val_tokens_n} is less than one block of model.max_seq_len + 1 "
                             f"= {self.seq_len + 1}")
        self.eod_id = data.get("doc_sep")  # the separator the model finds documents by (model.eod_id)
        self.doc_sep_role = data.get("doc_sep_role", "bos")
        check_values("data.", {"doc_sep": self.eod_id, "doc_sep_role": self.doc_sep_role}, DOC_KEYS)
        if self.eod_id is not None and self.eod_id >= self.vocab_size:
            raise ValueError(f"data.doc_sep={self.eod_id} is not a token of the vocabulary (ids below "
                             f"data.vocab_size={self.vocab_size}); GPT-2's <|endoftext|> is 50256")
        self.align_docs = data.get("align_docs", False)
        check_values("data.", {"align_docs": self.align_docs}, {"align_docs": bool})
        if self.align_docs and self.eod_id is None:
            raise ValueError("data.align_docs=true starts each training block at a document, found by data.doc_sep, "
                             "which is null: set data.doc_sep (GPT-2's <|endoftext|>: 50256), or data.align_docs=false")
        self.tokenizer = None

    def prepare_data(self) -> None:
        self.setup()

    def setup(self, stage: str | None = None) -> None:
        if self.tokenizer is not None:
            return
        train = open_shards(self.train_pattern, "data.train")
        val = open_shards(self.val_pattern, "data.val")
        if len(val) < self.val_tokens_n:
            raise ValueError(f"data.val_tokens={self.val_tokens_n}: the val shards ({self.val_pattern}) hold only "
                             f"{len(val)} tokens")
        self.train_tokens, self.val_tokens = train, val[: self.val_tokens_n]
        val_ids = self.val_tokens.read(0, len(self.val_tokens))  # the val tokens read: all of them, once
        if (top := int(val_ids.max())) >= self.vocab_size:
            raise ValueError(f"data.val: the shards hold token id {top}, not below data.vocab_size={self.vocab_size}")
        if self.eod_id is not None and not (val_ids == self.eod_id).any():
            log.warning("data.doc_sep=%d never occurs in the %d val tokens: is it the shards' separator? (each val "
                        "block would read as one document)", self.eod_id, len(val_ids))
        paths = shard_paths(self.train_pattern, "data.train")
        check_ids(paths, "data.train", self.vocab_size, self.cache_dir)  # every train id, not only the first ones
        if len(train) < self.seq_len + 1:
            raise ValueError(f"data.train={self.train_pattern}: {len(train)} tokens, less than one block of "
                             f"model.max_seq_len + 1 = {self.seq_len + 1}")
        val_sha256 = hashlib.sha256(val_ids.tobytes()).hexdigest()
        self.shards = {  # what a resume checks it reads again (lmlab.run.plan.check_same_data); val: the tokens it
                         # reads
            "data.train": {"shards": len(paths), "tokens": len(train), "sha256": fingerprint(paths, self.cache_dir)},
            "data.val": {"tokens": len(self.val_tokens), "sha256": val_sha256}}
        blocks = pack(train, self.seq_len + 1)
        if self.align_docs:
            blocks = AlignedBlocks(train, self.seq_len + 1, doc_starts(train, self.eod_id, self.doc_sep_role == "bos"))
            if not len(blocks):
                raise ValueError(f"data.align_docs=true: data.train ({self.train_pattern}) has no document start "
                                 f"(data.doc_sep={self.eod_id}) with a whole block of model.max_seq_len + 1 = "
                                 f"{self.seq_len + 1} tokens after it")
        self.train_dataset = TrainBlocks(blocks, self.seed)
        self.val_blocks = pack(self.val_tokens, self.seq_len + 1)
        if self.tokenizer_kind == NAME:
            self.tokenizer = stand_in_tokenizer(self.vocab_size)
        else:
            from tokenizers import Tokenizer

            self.tokenizer = Tokenizer.from_file(str(Path(self.tokenizer_kind).expanduser()))
        self.tokenizer_sha256 = hashlib.sha256(self.tokenizer.to_str().encode()).hexdigest()

    def train_dataloader(self) -> DataLoader:
        t = self.trainer
        step, accumulate, world, rank = (0, 1, 1, 0) if t is None else (
            t.global_step, t.accumulate_grad_batches, t.world_size, t.global_rank)
        if self.batch_stages is not None:
            return scheduled_loader(self, self.train_dataset, step, accumulate, world, rank)
        sampler = StepSampler(start=step * accumulate * self.batch_size * world, batch_size=self.batch_size,
                              rank=rank, world_size=world)
        return DataLoader(self.train_dataset, batch_size=self.batch_size, sampler=sampler,
                          num_workers=self.num_workers, pin_memory=torch.cuda.is_available())

    def val_dataloader(self) -> DataLoader:
        return DataLoader(Blocks(self.val_blocks), batch_size=self.batch_size, shuffle=False,
                          num_workers=self.num_workers)

    def val_windows(self, length: int) -> torch.Tensor:
        windows = pack(self.val_tokens, length + 1)
        if len(windows) == 0:
            raise ValueError(f"data.val_tokens={self.val_tokens_n} is fewer than length + 1 = {length + 1}")
        return torch.from_numpy(np.asarray(windows).astype(np.int64))

    def unigram_entropy(self, split: str = "val") -> float:
        """Entropy (nats) of the split's unigram distribution: all val tokens; the first UNIGRAM_SAMPLE of train."""
        stream = self.val_tokens if split == "val" else self.train_tokens
        counts = np.bincount(stream.read(0, min(len(stream), UNIGRAM_SAMPLE)), minlength=self.vocab_size)
        p = counts[counts > 0] / counts.sum()
        return float(-(p * np.log(p)).sum())

    def save_tokenizer(self, path: str | Path) -> None:
        atomic_write(Path(path), self.tokenizer.to_str())

    def callbacks(self, run_dir: str | Path) -> list[Any]:
        return []

    def figures(self) -> dict[str, Any]:
        return {}

    @staticmethod
    def compare_section(sweep_dir: Path, runs: list, overrides: dict, keys: list) -> str:
        return ""  # a corpus: compare's tables are the whole story

    def state_dict(self) -> dict[str, Any]:
        return {"tokenizer_sha256": self.tokenizer_sha256, "shards": self.shards} if self.tokenizer is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass  # plan.check_same_data compares the tokenizer and the shards before the fit
