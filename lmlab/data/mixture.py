"""`data=mixture`: several corpora in one run, each training block drawn from a source in proportion to its weight,
validated per source (`data.sources`, read and checked by lmlab/data/sources.py).

- **One tokenizer.** A path (`data.tokenizer=<tokenizer.json>`) is used as it is; `char` or `bpe` is trained on a
  sample of every text source's training part, `data.tokenizer_sample / <number of text sources>` characters of each
  (all of it when smaller), in name order. The weights play no part in it, so a sweep over the weights shares one
  tokenizer, one set of shards and one validation set: its losses are in the same units. A `token_bin` source holds
  ids already, so it needs `data.tokenizer` to be the tokenizer.json that wrote them, which the text sources then use.
- **Shards per source.** Each text source is tokenized into its own shards (`shards.py`, under the key a plain run
  with that tokenizer.json would use: `data=text_files data.tokenizer=<it>` on the same files shares them), split
  at `data.val_fraction` and packed into blocks of `max_seq_len + 1` as a plain corpus is; a `token_bin` source's
  .bin shards are read in place (the first `val_tokens` tokens of its val shards validate).
- **Training order**, a pure function of (seed, global block index i), as every corpus's: in chunk c = i // CHUNK
  (65,536 blocks) exactly n_s blocks come from source s, n_s = CHUNK · w_s / Σw rounded by largest remainder
  (`sources.shares`; summary.json's `mixture.<s>.fraction` = n_s / CHUNK), in an order shuffled by (seed, c). So
  block i comes from s with probability n_s / CHUNK, and every chunk holds the mixture exactly. The k-th block drawn
  from s is its item k in its own seeded epochs (`TrainBlocks`: by (seed, epoch) for the first source in name order,
  as a plain run of it reads, and by (seed, epoch, s) for the others). The sampler starts at the block the trainer has
  reached, so a resume reads exactly the uninterrupted run's batches, on any number of ranks.
- **Validation.** The first `data.val_windows` blocks of each source's validation split, in batches that never mix
  sources: `val/loss/<source>` is the mean loss over that source's blocks, and `val/loss` the mean over every
  source's blocks together (token-pooled; every block has `max_seq_len` targets): it does not depend on the weights,
  so the runs of a weight sweep are scored on the same tokens. The last values go to summary.json
  (`final_val_loss_by_source`) beside the sources' weights (`mixture`), and `eval.py compare=` tabulates them.
"""

from __future__ import annotations

import array
import bisect
import hashlib
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lmlab import names
from lmlab.data import shards
from lmlab.data.datamodule import TextDataModule, TrainBlocks, _pair, pack, split_tokens, training_sample
from lmlab.data.keys import DATA_SEED
from lmlab.data.shards import TokenStream
from lmlab.data.sources import CHUNK, NAME, BinSource, Source, check_sources, fingerprint, open_source, shares
from lmlab.data.tokenizer import TOKENIZERS, Sample, build_tokenizer, load_tokenizer, save_tokenizer
from lmlab.record.rundir import RunLock

log = logging.getLogger(__name__)

_CHUNK_STREAM = 2**63 + 0x6D6978  # the chunks' seeds [seed, c, this]: apart from every TrainBlocks' [seed, epoch, s]
UNIGRAM_SAMPLE = 10_000_000  # training tokens of each source its unigram distribution is counted on


class MixtureBlocks(Dataset):
    """Map-style and infinite: item i is source s's item k (`locate`), s and k as the module's docstring says."""

    def __init__(self, sources: list[TrainBlocks], counts: list[int], seed: int) -> None:
        self.sources, self.counts, self.seed = sources, counts, seed
        self._chunk, self._labels, self._ranks = -1, np.empty(0, np.int64), np.empty(0, np.int64)

    def _layout(self, c: int) -> None:
        """Chunk c's source per position and that position's rank among its source's (cached: read in order)."""
        if c == self._chunk:
            return
        labels = np.repeat(np.arange(len(self.counts)), self.counts)
        if len(self.counts) > 1:
            labels = np.random.default_rng([self.seed % 2**64, c, _CHUNK_STREAM]).permutation(labels)
        ranks = np.empty(CHUNK, dtype=np.int64)
        for s, n in enumerate(self.counts):
            ranks[labels == s] = np.arange(n)
        self._chunk, self._labels, self._ranks = c, labels, ranks

    def locate(self, i: int) -> tuple[int, int]:
        """(s, k): item i is the k-th block drawn from source s (k counts from 0 over the whole run)."""
        c, j = divmod(i, CHUNK)
        self._layout(c)
        s = int(self._labels[j])
        return s, c * self.counts[s] + int(self._ranks[j])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s, k = self.locate(i)
        return self.sources[s][k]


class SourceBlocks(Dataset):
    """Every source's validation blocks, one source after the other; an item is (input, target, its source's index)."""

    def __init__(self, sets: list[Any]) -> None:
        self.sets = sets
        self.offsets = np.cumsum([0] + [len(b) for b in sets]).tolist()

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, j: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        s = bisect.bisect_right(self.offsets, j) - 1
        return (*_pair(np.asarray(self.sets[s][j - self.offsets[s]])), torch.tensor(s))

    def batches(self, batch_size: int) -> list[list[int]]:
        """Batches of `batch_size` blocks that never mix sources (a source's last one may be smaller)."""
        return [list(range(a, min(a + batch_size, b))) for a, b in zip(self.offsets, self.offsets[1:])
                for a in range(a, b, batch_size)]


def mixture_sample(corpora: list[Any], limit: int | None, val_fraction: float, path: Path, anywhere: bool) -> Sample:
    """`training_sample` of each corpus, `limit / len(corpora)` characters each, one after the other in `path`."""
    share = None if limit is None else max(1, limit // len(corpora))
    ends = array.array("q")
    with open(path, "wb") as out:
        for k, corpus in enumerate(corpora):
            part = path.with_name(f"{path.name}.{k}")
            try:
                sample = training_sample(corpus.documents(), share, val_fraction, part, anywhere)
                base, left = out.tell(), sample.ends[-1] if len(sample.ends) else 0
                with open(part, "rb") as f:
                    while left > 0 and (chunk := f.read(min(left, 1 << 20))):
                        out.write(chunk)
                        left -= len(chunk)
                ends.extend(base + e for e in sample.ends)
            finally:
                part.unlink(missing_ok=True)
    return Sample(path, ends, anywhere)


class MixtureDataModule(TextDataModule):
    """`data=mixture`: the shared keys of every corpus (TextDataModule's: tokenizer, val_fraction, val_windows, ...)
    and `data.sources`. The training loader, the sampler and resume are TextDataModule's, over `MixtureBlocks`."""

    def _read_corpus(self, spec: dict[str, Any]) -> None:
        spec = {k: v for k, v in spec.items() if k != "name"}
        if unknown := sorted(spec.keys() - {"sources"}):
            raise ValueError(f"data=mixture does not take {['data.' + k for k in unknown]}: a source's own keys go "
                             f"under data.sources.<name>; data=mixture takes data.sources and the keys every corpus "
                             f"shares")
        self.corpus = NAME
        self.sources: list[Source] = check_sources({"sources": spec.get("sources"), "tokenizer": self.tokenizer_kind})
        self.counts = shares([s.weight for s in self.sources])
        self.last: dict[str, float] | None = None  # val/loss/<source> at the last validation

    # --- building ---

    def _build(self) -> None:
        if self.tokenizer is not None:
            return
        opened = {s.name: open_source(s, self.cache_dir) for s in self.sources}
        texts = {name: c for name, c in opened.items() if not isinstance(c, BinSource)}
        tok, recipe = self._shared_tokenizer(texts)
        self.tokenizer_sha256 = hashlib.sha256(tok.to_str().encode()).hexdigest()
        self.vocab_size, self.eod_id = tok.get_vocab_size(), None if self.eod is None else tok.token_to_id(self.eod)
        self.shards = {"data.sources": {"sha256": fingerprint(self.sources)}}  # what a resume checks it reads again
        self.train_sets, self.val_sets, self.val_streams = {}, {}, {}
        block = self.seq_len + 1
        for s in self.sources:
            key = f"data.sources.{s.name}"
            if s.name in texts:
                train, val, self.shards[key] = self._text(key, texts[s.name], tok, recipe)
                why = f"data.val_fraction={self.val_fraction} leaves"
            else:
                train, val, self.shards[key] = self._bin(key, opened[s.name])
                why = "its shards give"
            for side, tokens in (("training", train), ("validation", val)):
                if len(tokens) < block:
                    raise ValueError(f"{key}: {why} {len(tokens)} {side} tokens, fewer than one block of "
                                     f"model.max_seq_len + 1 = {block}; give the source more text, or lower "
                                     f"model.max_seq_len")
            self.train_sets[s.name], self.val_streams[s.name] = pack(train, block), val
            self.val_sets[s.name] = pack(val, block)[: self._max_val_blocks]
        self.train_dataset = MixtureBlocks([TrainBlocks(self.train_sets[s.name], self.seed, stream=k)
                                            for k, s in enumerate(self.sources)], self.counts, self.seed)
        self.tokenizer = tok
        log.info(f"data=mixture: vocab {self.vocab_size}; " + ", ".join(
            f"{s.name} {n / CHUNK:.4f} of the blocks, {len(self.train_sets[s.name])} / {len(self.val_sets[s.name])} "
            f"train / val blocks" for s, n in zip(self.sources, self.counts)))

    def _shared_tokenizer(self, texts: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
        """The tokenizer every source is read with, and the recipe its text sources' shards are keyed by."""
        if self.tokenizer_kind not in TOKENIZERS:  # a tokenizer.json: as a plain corpus takes it (the same shards)
            tok = build_tokenizer(self.tokenizer_kind, [], vocab_size=self.bpe_vocab_size, cache_dir=self.cache_dir,
                                  eod=self.eod)
            return tok, self._recipe()
        key = shards.shard_key(mixture=[[name, c.fingerprint] for name, c in texts.items()], **self._recipe())
        directory = self.cache_dir / "shards" / f"mixture-{key}"
        path = directory / "tokenizer.json"
        if not path.is_file():
            with RunLock(directory, wait=True):  # a second job of the sweep waits, then reads it
                if not path.is_file():
                    spool = directory / ".sample.tmp"
                    try:
                        sample = mixture_sample(list(texts.values()), self.tokenizer_sample, self.val_fraction, spool,
                                                self.tokenizer_kind == "char")
                        tok = build_tokenizer(self.tokenizer_kind, sample, vocab_size=self.bpe_vocab_size,
                                              cache_dir=self.cache_dir, eod=self.eod)
                    finally:
                        spool.unlink(missing_ok=True)
                    save_tokenizer(tok, path)
        return load_tokenizer(path), {"tokenizer_file": hashlib.sha256(path.read_bytes()).hexdigest(), "eod": self.eod}

    def _text(self, key: str, corpus: Any, tok: Any, recipe: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
        """A text source's training and validation tokens from its own shards, and its record."""
        directory = self.cache_dir / "shards" / shards.shard_key(corpus=corpus.fingerprint, **recipe)

        def prepare() -> dict[str, Any]:
            directory.mkdir(parents=True, exist_ok=True)
            save_tokenizer(tok, directory / "tokenizer.json")
            return shards.write(directory, corpus.units(self.shard_size), corpus=corpus.fingerprint, recipe=recipe,
                                eod=self.eod, num_proc=self.num_proc)

        index = shards.prepared(directory, prepare)
        shards.load_tokenizer(directory, index)  # checked against its index
        tokens = TokenStream.open(directory, index)
        if len(tokens) == 0:
            raise ValueError(f"{key}: the corpus is empty (no tokens)")
        return (*split_tokens(tokens, self.val_fraction), {"tokens": len(tokens), "sha256": corpus.fingerprint})

    def _bin(self, key: str, source: BinSource) -> tuple[Any, Any, dict[str, Any]]:
        """A token_bin source's training stream and validation tokens, every id checked below the vocabulary."""
        from lmlab.data import token_bin

        paths = token_bin.shard_paths(source.train, f"{key}.train")
        train, val = token_bin.open_shards(source.train, f"{key}.train"), token_bin.open_shards(source.val,
                                                                                                 f"{key}.val")
        want = source.val_tokens
        if want is not None and len(val) < want:
            raise ValueError(f"{key}.val_tokens={want}: the val shards ({source.val}) hold only {len(val)} tokens")
        if want is None:  # as many as the validation blocks take
            want = len(val) if self._max_val_blocks is None else self._max_val_blocks * (self.seq_len + 1)
        val = val[: want]
        tops = [(p, token_bin.shard_facts(p, source.cache_dir)["max"]) for p in paths]
        tops.append((f"{source.val} (its first {len(val)} tokens)", int(val.read(0, len(val)).max())))
        for where, top in tops:
            if top >= self.vocab_size:
                raise ValueError(f"{key}: {where} holds token id {top}, not below the {self.vocab_size} tokens of "
                                 f"data.tokenizer={self.tokenizer_kind}: not the tokenizer that wrote the shards")
        return train, val, {"shards": len(paths), "tokens": len(train),
                            "sha256": token_bin.fingerprint(paths, source.cache_dir)}

    # --- what the training loop reads (the training loader is TextDataModule's) ---

    def val_dataloader(self) -> DataLoader:
        """Every rank evaluates the same fixed blocks of every source, in batches that never mix sources."""
        self._require_setup()
        blocks = SourceBlocks([self.val_sets[s.name] for s in self.sources])
        return DataLoader(blocks, batch_sampler=blocks.batches(self.batch_size), num_workers=self.num_workers,
                          pin_memory=torch.cuda.is_available(), persistent_workers=self.num_workers > 0)

    def val_windows(self, length: int) -> torch.Tensor:
        """Every source's first `data.val_windows` windows of `length + 1` validation tokens, one source after the
        other (eval.py's loss per length: pooled, as val/loss)."""
        self._require_setup()
        windows = []
        for name, tokens in self.val_streams.items():
            if len(tokens) < length + 1:
                raise ValueError(f"data.sources.{name}: its validation split has {len(tokens)} tokens, fewer than "
                                 f"length + 1 = {length + 1}; evaluate a shorter length")
            windows.append(np.asarray(pack(tokens, length + 1)[: self._max_val_blocks]))
        return torch.from_numpy(np.concatenate(windows).astype(np.int64))

    def unigram_entropy(self, split: str = "val") -> float:
        """Entropy (nats) of the targets' unigram distribution: the validation blocks of every source pooled (as
        val/loss), or the training mixture (each source's distribution, counted on its first UNIGRAM_SAMPLE training
        tokens, weighted by its share of the blocks)."""
        self._require_setup()
        if split not in ("train", "val"):
            raise ValueError(f"split={split!r}; choose 'train' or 'val'")
        if split == "val":
            p = sum(self.val_sets[s.name].target_counts(self.vocab_size).astype(np.float64) for s in self.sources)
            p /= p.sum()
        else:
            p = np.zeros(self.vocab_size)
            for s, n in zip(self.sources, self.counts):
                blocks = self.train_sets[s.name]
                counts = blocks[: max(1, UNIGRAM_SAMPLE // blocks.block)].target_counts(self.vocab_size)
                p += n / CHUNK * counts / counts.sum()
        p = p[p > 0]
        return float(-(p * np.log(p)).sum())

    # --- the task protocol (lmlab.data.tasks): the per-source losses, in summary.json and compare ---

    def callbacks(self, run_dir: str | Path) -> list[Any]:
        from lmlab.data.callbacks import SourceLosses  # Lightning's: training imports it, eval.py does not

        return [SourceLosses(self)]

    def figures(self) -> dict[str, Any]:
        return {"final_val_loss_by_source": self.last,
                "mixture": {s.name: {"name": s.kind, "weight": s.weight, "fraction": n / CHUNK,
                                     "train_tokens": len(self.train_sets[s.name].stream),
                                     "val_blocks": len(self.val_sets[s.name])}
                            for s, n in zip(self.sources, self.counts)} if self.tokenizer is not None else None}

    @staticmethod
    def compare_section(sweep_dir: Path, runs: list[Path], overrides: dict[Path, dict[str, str]],
                        keys: list[str]) -> str:
        """compare_sources.{md,csv}: one row per run whose summary has per-source val losses (its keys, val/loss, and
        val/loss/<source> at the last validation); "" when none has."""
        from lmlab.record.rundir import RunDir
        from lmlab.record.tables import write_table

        rows, sources = [], set()
        for r in runs:
            try:
                summary = RunDir(r).read_summary() or {}
            except ValueError:  # unreadable: compare's main table flags it
                continue
            by_source = summary.get("final_val_loss_by_source")
            if not isinstance(by_source, dict) or not by_source:
                continue
            sources |= set(by_source)
            rows.append({**{k: overrides[r].get(k, "") for k in keys}, names.VAL_LOSS: summary.get("final_val_loss"),
                         **{names.val_loss(s): v for s, v in by_source.items()}})
        if not rows:
            return ""
        cols = [*keys, names.VAL_LOSS, *(names.val_loss(s) for s in sorted(sources))]
        return ("\nValidation loss per source (data=mixture: the last validation; val/loss pools every source's "
                "blocks)\n\n" + write_table(rows, cols, sweep_dir / "compare_sources"))

    # --- checkpoint: a resume on other sources is refused (lmlab.run.plan.check_same_data reads `shards`) ---

    def state_dict(self) -> dict[str, Any]:
        if self.tokenizer is None:
            return {}
        return {"tokenizer_sha256": self.tokenizer_sha256, "shards": self.shards, "seed": self.seed,
                "seq_len": self.seq_len, "weights": {s.name: s.weight for s in self.sources}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.tokenizer is None or not state:
            return
        if state["tokenizer_sha256"] != self.tokenizer_sha256:
            raise ValueError(f"the checkpoint was trained with another tokenizer than data.tokenizer="
                             f"{self.tokenizer_kind} builds now over data.sources; resume with the run's config")
        now = {"seed": self.seed, "seq_len": self.seq_len, "weights": {s.name: s.weight for s in self.sources}}
        if changed := [k for k, v in now.items() if state.get(k, v) != v]:
            changed = ", ".join(DATA_SEED if k == "seed" else k for k in changed)
            rank_zero_warn(f"resuming data=mixture with a different {changed} than the checkpoint: the blocks drawn "
                           f"from here on do not continue its order")
