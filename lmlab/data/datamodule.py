"""`TextDataModule`: corpus -> tokenizer -> token shards -> fixed blocks of `seq_len + 1` tokens.

Why it looks the way it does:
- The corpus streams through the tokenizer once, in `num_proc` processes, into token shards under
  `<cache_dir>/shards/<key>/` (`shards.py`), keyed by the corpus fingerprint and the tokenizer recipe; the
  first job of a sweep prepares them (the others wait on a lock), every job memory-maps them. Nothing
  holds the corpus in memory, so a job on prepared shards starts in seconds whatever the corpus size.
- The tokenizer is trained on the first `tokenizer_sample` characters of the training part (all of it
  for a corpus smaller than that, as the default one is), spooled to a file beside the shards and read back
  a MB at a time: the main process never holds it (100 M characters are 100-400 MB as Python strings).
- The split is at token `int(n * (1 - val_fraction))` of the stream (documents in sorted path order)
  and each side is packed on its own, so no block straddles train and validation.
- Training order is a pure function of (seed, global sample index): item i is block perm_e[i mod n],
  e = i // n, perm_e seeded by (seed, e). The sampler starts at the index the trainer has reached, so a
  resumed run reads exactly the batches the uninterrupted run would have read, on any number of ranks.
- Validation reads the same first `val_windows` blocks of the validation split in every run, so
  val losses of different runs are computed on identical windows.

The module takes plain values (no Hydra) and can be set up before `trainer.fit`, so the model can be
built with `vocab_size`.
"""

from __future__ import annotations

import array
import bisect
import codecs
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np
import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset, Sampler

from lmlab.data import shards, stages
from lmlab.data.corpus import CORPORA
from lmlab.data.keys import DATA_KEYS, DATA_SEED, SHARD_KEYS  # noqa: F401  (importable here, as before)
from lmlab.data.padded import PaddedRows, pad_documents
from lmlab.data.padded import pair as padded_pair
from lmlab.data.shards import BlockView, TokenStream
from lmlab.data.tokenizer import TOKENIZERS, Sample, build_tokenizer, check_tokenizer, save_tokenizer
from lmlab.record.rundir import remember
from lmlab.registry import check_values, option_params

log = logging.getLogger(__name__)

# The keys every conf/data/*.yaml shares; the remaining keys belong to the corpus loader.
_DEFAULTS: dict[str, Any] = {
    "tokenizer": "char",
    "vocab_size": 4096,
    "val_fraction": 0.05,
    "batch_size": 32,
    "val_windows": 640,
    "num_workers": 0,
    "cache_dir": None,  # None: $LMLAB_CACHE, else ~/.cache/lmlab (as in conf/data/*.yaml)
    "num_proc": None,  # None: every core this process may use
    "eod": None,  # the end-of-document token's text (e.g. "<|endoftext|>"); None: documents simply follow each other
    "tokenizer_sample": 100_000_000,  # characters of the training part a trained tokenizer learns from; None: all
    "shard_size": 1 << 23,  # text per token shard: bytes of files (whole files), characters of dataset rows
    "packing": "packed",  # packed: documents follow each other in full blocks; padded: each its own rows (padded.py)
    "batch_schedule": None,  # the batch by stage (lmlab.data.stages); None: data.batch_size throughout
    "seq_schedule": None,  # the training sequences' length by stage (read by the loop: lmlab.run.lit)
    "batch_lr_power": 0.0,  # the lr x (B/B0)^p under batch_schedule (read by the loop)
}




def usable_cpus() -> int:
    """The cores this process may run on (its affinity mask on Linux; all of them where there is none, e.g. macOS)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this OS (macOS, Windows)
        return os.cpu_count() or 1


def train_text(texts: list[str], val_fraction: float) -> list[str]:
    """The documents up to the character where validation starts: all the tokenizer may learn from.

    For `char` this is exactly the training token split; for `bpe` the token split lands within a few
    characters of it, which only affects which merges are learned.
    """
    return _head(texts, int(sum(map(len, texts)) * (1 - val_fraction)))


def _head(texts: list[str], cut: int) -> list[str]:
    head = []
    for text in texts:
        if cut <= 0:
            break
        head.append(text[:cut])
        cut -= len(text)
    return head


def training_sample(documents: Iterator[Iterator[str]], limit: int | None, val_fraction: float, path: Path,
                    anywhere: bool = True) -> Sample:
    """The first `limit` characters of the corpus' training part, one text per document, spooled to `path` (see
    `Sample`; `anywhere`: its pieces may be cut anywhere, as for char tokenizers), reading no further than needed: once
    `limit / (1 - val_fraction)` characters have been seen the sample cannot reach the validation part. A corpus that
    ends sooner gives `train_text` of it, capped at `limit` (the default corpus: exactly its training part)."""
    reach = None if limit is None else math.ceil(limit / (1 - val_fraction))
    ends, chars = array.array("q"), array.array("q")  # where each document's text ends: bytes, characters
    taken = seen = 0
    with open(path, "wb") as f:
        for doc in documents:
            for piece in doc:
                if limit is None or taken < limit:
                    part = piece if limit is None else piece[: limit - taken]
                    f.write(part.encode("utf-8"))
                    taken += len(part)
                seen += len(piece)
                if reach is not None and seen >= reach:
                    break
            ends.append(f.tell())
            chars.append(taken)
            if reach is not None and seen >= reach:
                return Sample(path, ends, anywhere)
    # As _head(texts, cut): the documents that start before the cut, the last of them cut there.
    cut = min(taken, int(seen * (1 - val_fraction)))
    n = bisect.bisect_left(chars, cut) + 1 if cut > 0 else 0
    ends, chars = ends[:n], chars[:n]
    if n and chars[-1] > cut:
        start = ends[-2] if n > 1 else 0
        ends[-1] = start + _utf8_bytes(path, start, cut - (chars[-2] if n > 1 else 0))
    return Sample(path, ends, anywhere)


def _utf8_bytes(path: Path, start: int, k: int) -> int:
    """How many bytes the first `k` characters of the UTF-8 text from byte `start` of `path` take."""
    decoder, n = codecs.getincrementaldecoder("utf-8")(), 0
    with open(path, "rb") as f:
        f.seek(start)
        while k > 0 and (chunk := f.read(1 << 20)):
            text = decoder.decode(chunk)
            if len(text) >= k:
                return n + len(text[:k].encode("utf-8"))
            k, n = k - len(text), n + len(text.encode("utf-8"))
    return n


def split_tokens(tokens: Any, val_fraction: float) -> tuple[Any, Any]:
    cut = int(len(tokens) * (1 - val_fraction))
    return tokens[:cut], tokens[cut:]


def pack(tokens: Any, block: int) -> Any:
    """Non-overlapping blocks, shape (n, block); the last `len % block` tokens are dropped."""
    if isinstance(tokens, TokenStream):
        return BlockView(tokens, block)
    n = len(tokens) // block
    return tokens[: n * block].reshape(n, block)


def _pair(block: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(block, PaddedRows):  # data.packing=padded: its padding masked
        return padded_pair(block)
    t = torch.from_numpy(block.astype(np.int64))
    return t[:-1], t[1:]  # input, target: (seq_len,) each


class TrainBlocks(Dataset):
    """Map-style and infinite: item i is block perm_e[i % n], e = i // n, perm_e seeded by (seed, e); `stream` > 0
    (a mixture's later sources, lmlab.data.mixture) seeds it by (seed, e, stream) instead."""

    def __init__(self, blocks: np.ndarray, seed: int, stream: int = 0) -> None:
        self.blocks, self.seed, self.stream = blocks, seed, stream
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:  # items are read in index order, so one cached epoch is enough
            rng = np.random.default_rng([self.seed % 2**64, epoch, *([self.stream] if self.stream else [])])
            n = len(self.blocks)
            # shuffled in place as int32 below 2^31 blocks: the same order as rng.permutation(n) (Fisher-Yates draws
            # the same indices whatever the dtype), in half its memory (4 bytes a block: 31 MB at 1 GB of characters)
            self._epoch, self._order = epoch, rng.permutation(np.arange(n, dtype=np.int32 if n < 2**31 else np.int64))
        return self._order

    def block_index(self, i: int) -> int:
        n = len(self.blocks)
        return int(self.order(i // n)[i % n])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _pair(self.blocks[self.block_index(i)])


class Blocks(Dataset):
    """Fixed blocks in order (validation)."""

    def __init__(self, blocks: np.ndarray) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _pair(self.blocks[i])


class StepSampler(Sampler[int]):
    """Global sample indices start, start+1, ... forever; rank r of w takes slice r of every global batch.

    Global batch b covers indices start + b*w*bs ... start + (b+1)*w*bs - 1; rank r reads
    start + b*w*bs + r*bs ... + bs - 1, so ranks see disjoint data and together see every index.
    """

    def __init__(self, *, start: int, batch_size: int, rank: int = 0, world_size: int = 1) -> None:
        self.start, self.batch_size, self.rank, self.world_size = start, batch_size, rank, world_size

    def __iter__(self) -> Iterator[int]:
        first = self.start + self.rank * self.batch_size
        while True:
            yield from range(first, first + self.batch_size)
            first += self.world_size * self.batch_size


def scheduled(spec: dict[str, Any], seq_len: int) -> stages.Stages | None:
    """Pop the schedule keys off a data spec (lmlab.data.stages), checked; the batch stages (None: none)."""
    batch = stages.check("data.batch_schedule", spec.pop("batch_schedule", None))
    stages.check("data.seq_schedule", spec.pop("seq_schedule", None), limit=seq_len, divides=seq_len)
    check_values("data.", {"batch_lr_power": spec.pop("batch_lr_power", 0.0)},
                 {"batch_lr_power": DATA_KEYS["batch_lr_power"]})
    return batch


def scheduled_loader(data: Any, dataset: Any, step: int, accumulate: int, world: int, rank: int) -> DataLoader:
    """The training loader under data.batch_schedule: `ScheduledBatches` from optimizer step `step` on."""
    max_steps = data.trainer.max_steps if data.trainer is not None else 1
    sampler = stages.ScheduledBatches(start_step=step, max_steps=max_steps, stages=data.batch_stages,
                                      batch_size=data.batch_size, rank=rank, world_size=world, accumulate=accumulate)
    return DataLoader(dataset, batch_sampler=sampler, num_workers=data.num_workers,
                      pin_memory=torch.cuda.is_available())


class TextDataModule:
    """`data` is the composed `data` config group as a plain dict; `seq_len` is `model.max_seq_len`."""

    trainer: Any = None  # the Lightning trainer while one runs this data (lmlab.run.lit_data): the step, the ranks
    eod_id: int | None = None  # the task protocol's (lmlab.data.tasks): None until the data gives one
    labels: list[str] | None = None  # a labelled set's (head=classify's); none here
    tokenizer: Any = None  # the corpus's tokenizer once built
    shards: Mapping[str, Any] = MappingProxyType({})  # what else a resume checks (lmlab.run.plan.check_same_data)
    corpus_sha256: str | None = None  # the corpus's fingerprint (the same check), set when built

    def __init__(self, data: Mapping[str, Any], *, seq_len: int, seed: int) -> None:
        spec = {**_DEFAULTS, **dict(data)}
        self.tokenizer_kind = str(spec.pop("tokenizer"))
        self.bpe_vocab_size = int(spec.pop("vocab_size"))
        self.val_fraction = float(spec.pop("val_fraction"))
        self.batch_size = int(spec.pop("batch_size"))
        self.val_windows_n = spec.pop("val_windows")
        self.num_workers = int(spec.pop("num_workers"))
        self.cache_dir = Path(spec.pop("cache_dir") or os.environ.get("LMLAB_CACHE", "~/.cache/lmlab")).expanduser()
        num_proc = spec.pop("num_proc")
        self.num_proc = usable_cpus() if num_proc is None else num_proc
        self.eod, self.tokenizer_sample, self.shard_size = (spec.pop(k) for k in ("eod", "tokenizer_sample",
                                                                                   "shard_size"))
        self.packing = spec.pop("packing")
        self.seq_len, self.seed = int(seq_len), int(seed)
        self.batch_stages = scheduled(spec, self.seq_len)
        self._read_corpus(spec)
        self._check()
        self.tokenizer = None

    def _read_corpus(self, spec: dict[str, Any]) -> None:
        """The corpus option's own keys (`spec`: `data` less the shared keys), checked."""
        self.corpus, self.corpus_kwargs = option_params("data", CORPORA, spec)

    def _check(self) -> None:
        """Everything that can be checked without reading the corpus, so bad values fail at construction."""
        if not 0 < self.val_fraction < 1:
            raise ValueError(f"data.val_fraction={self.val_fraction} must be strictly between 0 and 1")
        for key, value in {"data.batch_size": self.batch_size, "model.max_seq_len": self.seq_len}.items():
            if value < 1:
                raise ValueError(f"{key}={value} must be at least 1")
        if self.val_windows_n is not None and int(self.val_windows_n) < 1:
            raise ValueError(f"data.val_windows={self.val_windows_n} must be at least 1, or null for the whole split")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers={self.num_workers} must be at least 0")
        check_values("data.", {"num_proc": self.num_proc, "shard_size": self.shard_size, "eod": self.eod,
                               "tokenizer_sample": self.tokenizer_sample}, SHARD_KEYS)
        if self.eod == "":
            raise ValueError("data.eod='' must be a non-empty string (the token's text), or null for none")
        check_values("data.", {"packing": self.packing}, {"packing": DATA_KEYS["packing"]})
        if self.packing == "padded" and self.eod is None:
            raise ValueError("data.packing=padded gives each document its own rows, found by their end-of-document "
                             "token, and data.eod is null: set data.eod (e.g. data.eod='<|endoftext|>'), or "
                             "data.packing=packed")
        check_tokenizer(self.tokenizer_kind, vocab_size=self.bpe_vocab_size)

    # --- building (idempotent; every step after the first run is a cache hit) ---

    def prepare_data(self) -> None:
        """Lightning calls this on one process per node first: the fetch and the tokenization happen there."""
        self._build()

    def setup(self, stage: str | None = None) -> None:
        self._build()

    def _build(self) -> None:
        if self.tokenizer is not None:
            return
        source = CORPORA[self.corpus](**self.corpus_kwargs, cache_dir=self.cache_dir)
        self.corpus_sha256 = source.fingerprint
        recipe = self._recipe()
        directory = self.cache_dir / "shards" / shards.shard_key(corpus=source.fingerprint, **recipe)
        index = shards.prepared(directory, lambda: self._prepare(source, directory, recipe))
        tok = shards.load_tokenizer(directory, index)
        self.tokenizer_sha256 = hashlib.sha256(tok.to_str().encode()).hexdigest()
        self.shard_dir, self.eod_id = directory, index["eod_id"]
        tokens = TokenStream.open(directory, index)
        if len(tokens) == 0:
            raise ValueError(f"data={self.corpus}: the corpus is empty (no tokens)")

        self.train_tokens, self.val_tokens = split_tokens(tokens, self.val_fraction)
        train_blocks, val_blocks = (self._rows(t) for t in (self.train_tokens, self.val_tokens))
        for side, side_tokens in (("training", self.train_tokens), ("validation", self.val_tokens)):
            if len(side_tokens) < self.seq_len + 1:
                raise ValueError(
                    f"data.val_fraction={self.val_fraction} leaves {len(side_tokens)} {side} tokens, fewer than one "
                    f"block of model.max_seq_len + 1 = {self.seq_len + 1}; change data.val_fraction, lower "
                    f"model.max_seq_len or use a larger corpus ({len(tokens)} tokens)"
                )
        if len(train_blocks) == 0 or len(val_blocks) == 0:  # data.packing=padded: documents of one token only
            raise ValueError(f"data.packing=padded leaves {len(train_blocks)} / {len(val_blocks)} training / "
                             f"validation rows: no document has two tokens; check data.eod, or data.packing=packed")
        self.train_dataset = TrainBlocks(train_blocks, self.seed)
        self.val_blocks = val_blocks[: self._max_val_blocks]
        self.vocab_size: int = tok.get_vocab_size()
        self.tokenizer = tok
        blocks = f"{len(train_blocks)} / {len(self.val_blocks)} blocks of {self.seq_len + 1}"
        log.info(
            f"data={self.corpus}: {len(self.train_tokens)} / {len(self.val_tokens)} train / val tokens, {blocks}, "
            f"vocab {self.vocab_size}"
        )

    def _rows(self, tokens: TokenStream) -> Any:
        """The (n, seq_len + 1) rows of a split: packed blocks, or each document's padded pieces."""
        if self.packing == "padded":
            return pad_documents(np.asarray(tokens), self.seq_len + 1, self.eod_id)
        return pack(tokens, self.seq_len + 1)

    def _recipe(self) -> dict[str, Any]:
        """Everything besides the corpus that decides the token ids (the shards' cache key)."""
        kind = self.tokenizer_kind
        if kind not in TOKENIZERS:  # a tokenizer.json: its content, not its path
            return {"tokenizer_file": hashlib.sha256(Path(kind).expanduser().read_bytes()).hexdigest(), "eod": self.eod}
        return {"tokenizer": kind, "vocab_size": self.bpe_vocab_size if kind == "bpe" else 0, "eod": self.eod,
                "sample": self.tokenizer_sample, "val_fraction": self.val_fraction}

    def _prepare(self, source: Any, directory: Path, recipe: dict[str, Any]) -> dict[str, Any]:
        """Train the tokenizer on the sample, tokenize the corpus into shards, write the index last."""
        started = time.time()
        directory.mkdir(parents=True, exist_ok=True)
        spool = directory / ".sample.tmp"  # the tokenizer's sample, on disk rather than in this process's memory
        try:
            sample = [] if self.tokenizer_kind not in TOKENIZERS else training_sample(
                source.documents(), self.tokenizer_sample, self.val_fraction, spool, self.tokenizer_kind == "char")
            tok = build_tokenizer(self.tokenizer_kind, sample, vocab_size=self.bpe_vocab_size,
                                  cache_dir=self.cache_dir, eod=self.eod)
        finally:
            spool.unlink(missing_ok=True)
        save_tokenizer(tok, directory / "tokenizer.json")
        tokenizer_s = time.time() - started
        index = shards.write(directory, source.units(self.shard_size), corpus=self.corpus_sha256, recipe=recipe,
                             eod=self.eod, num_proc=self.num_proc)
        self.preparation = {"tokenizer_s": tokenizer_s, "shards_s": time.time() - started - tokenizer_s,
                            "num_proc": self.num_proc}
        log.info(f"data={self.corpus}: {index['tokens']} tokens in {len(index['shards'])} shards, prepared in "
                 f"{time.time() - started:.1f} s ({tokenizer_s:.1f} s the tokenizer, the rest the shards) with "
                 f"{self.num_proc} process(es): {directory}")
        return index

    # --- what the training loop reads ---

    @property
    def _max_val_blocks(self) -> int | None:
        return None if self.val_windows_n is None else int(self.val_windows_n)

    def _require_setup(self) -> None:
        if self.tokenizer is None:
            raise RuntimeError("TextDataModule: call setup() (or trainer.fit) before reading data")

    def _progress(self) -> tuple[int, int, int, int]:
        """(optimizer steps done, accumulation, world size, rank); a restored trainer reports the resumed step."""
        t = self.trainer
        if t is None:
            return 0, 1, 1, 0
        return t.global_step, t.accumulate_grad_batches, t.world_size, t.global_rank

    def train_dataloader(self) -> DataLoader:
        self._require_setup()
        step, accumulate, world_size, rank = self._progress()
        if self.batch_stages is not None:  # data.batch_schedule: batches sized by the step (lmlab.data.stages)
            return scheduled_loader(self, self.train_dataset, step, accumulate, world_size, rank)
        start = step * accumulate * self.batch_size * world_size  # global samples consumed so far
        sampler = StepSampler(start=start, batch_size=self.batch_size, rank=rank, world_size=world_size)
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
        )

    def val_dataloader(self) -> DataLoader:
        """Every rank evaluates the same fixed windows: exact and identical for any world size."""
        self._require_setup()
        return DataLoader(
            Blocks(self.val_blocks),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=self.num_workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=self.num_workers > 0,
        )

    def val_windows(self, length: int) -> torch.Tensor:
        """Fixed non-overlapping windows of `length + 1` validation tokens, (n, length + 1), for extrapolation."""
        self._require_setup()
        windows = pack(self.val_tokens, length + 1)[: self._max_val_blocks]
        if len(windows) == 0:
            raise ValueError(
                f"the validation split has {len(self.val_tokens)} tokens, fewer than length + 1 = "
                f"{length + 1}; raise data.val_fraction or evaluate a shorter length"
            )
        return torch.from_numpy(np.asarray(windows).astype(np.int64))

    def unigram_entropy(self, split: str = "val") -> float:
        """Entropy (nats) of the target tokens the split's loader yields: the loss of the best unigram model."""
        self._require_setup()
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}; choose 'train' or 'val'")
        blocks = self.train_dataset.blocks if split == "train" else self.val_blocks
        padded = "-padded" if self.packing == "padded" else ""  # its targets leave the padding out
        memo = self.shard_dir / f"unigram-{split}-{self.seq_len}-{self.val_windows_n}{padded}.json"
        if memo.is_file():  # the train split of a big corpus takes seconds to count: once per sweep
            return json.loads(memo.read_text())["entropy"]
        counts = blocks.target_counts(self.vocab_size)
        p = counts[counts > 0] / counts.sum()
        entropy = float(-(p * np.log(p)).sum())
        remember(memo, json.dumps({"entropy": entropy}))  # a read-only shared cache serves any length too
        return entropy

    def save_tokenizer(self, path: str | Path) -> None:
        self._require_setup()
        save_tokenizer(self.tokenizer, path)

    # --- the task protocol (lmlab.data.tasks): a corpus has no callbacks or figures of its own ---

    evaluable = True

    def callbacks(self, run_dir: str | Path) -> list[Any]:
        return []

    def figures(self) -> dict[str, Any]:
        return {}

    # --- checkpoint: refuse to resume with another tokenizer ---

    def state_dict(self) -> dict[str, Any]:
        if self.tokenizer is None:
            return {}
        keys = ("tokenizer_sha256", "corpus_sha256", "seed", "seq_len")
        return {k: getattr(self, k) for k in keys}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tokenizer is None or not state:
            return
        if state["tokenizer_sha256"] != self.tokenizer_sha256:
            raise ValueError(
                f"the checkpoint was trained with another tokenizer than data.tokenizer={self.tokenizer_kind!r} "
                "builds now (different corpus, data.val_fraction or data.vocab_size?); resume with the run's config"
            )
        changed = [k for k in ("corpus_sha256", "seed", "seq_len") if state[k] != getattr(self, k)]
        if changed:
            changed = ", ".join(DATA_SEED if k == "seed" else k for k in changed)
            rank_zero_warn(f"resuming with a different {changed} than the checkpoint: the data order will not match")
