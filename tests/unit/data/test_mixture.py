"""data=mixture (lmlab/data/mixture.py, lmlab/data/sources.py): each training block comes from source s in proportion
to its weight (exactly n_s of every chunk of CHUNK blocks, n_s the largest-remainder share of w_s / Σw, in a seeded
order: over many steps within a binomial bound of the weights), each source's blocks read in its own seeded epochs,
the order a pure function of (seed, index); a mixture of one source reads exactly the plain option's tokens, blocks
and training order; val/loss/<source> is the mean loss over that source's validation blocks and val/loss the pooled
mean over every source's, computed by hand on a tiny model; a token_bin source shares the tokenizer of the text
sources; every bad input is refused naming its key and what it takes, before training."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab import compose
from lmlab.data.datamodule import TextDataModule, TrainBlocks
from lmlab.data.mixture import MixtureBlocks, MixtureDataModule
from lmlab.data.sources import CHUNK, check_sources, shares
from lmlab.data.token_bin import write_shard
from tests.runs import write_corpus

SEQ = 15


def write_code(d: Path, lines: int = 1200) -> Path:
    """Python-like lines (another style than write_corpus's sentences): digits, brackets, indentation."""
    rng = random.Random(1)
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(lines):
        a, b = rng.randint(0, 99), rng.randint(0, 9)
        out.append(f"def f{i % 50}(x):\n    return [x * {a} + {b}, (x - {b})]\n" if i % 3 else f"y = f{b}({a})\n")
    (d / "code.txt").write_text("".join(out))
    return d


@pytest.fixture
def styles(tmp_path: Path) -> dict[str, Path]:
    return {"prose": write_corpus(tmp_path / "prose"), "code": write_code(tmp_path / "code")}


def mixture(tmp_path: Path, sources: dict, *, seq_len: int = SEQ, seed: int = 0, **data) -> MixtureDataModule:
    spec = {"name": "mixture", "sources": sources, "cache_dir": str(tmp_path / "cache"), "batch_size": 4,
            "val_windows": 6, "val_fraction": 0.1, **data}
    dm = MixtureDataModule(spec, seq_len=seq_len, seed=seed)
    dm.setup("fit")
    return dm


# --- the order ---


def _blocks(n: int, tag: int) -> TrainBlocks:
    return TrainBlocks(np.arange(n * 3).reshape(n, 3) + tag * 10**6, seed=0)


def test_shares_are_the_largest_remainder_apportionment_of_the_chunk() -> None:
    assert shares([0.7, 0.3]) == [45875, 19661] and sum(shares([0.7, 0.3])) == CHUNK  # 45875.2, 19660.8
    assert shares([1, 1, 1]) == [21846, 21845, 21845]  # one remainder left: to the first of the tied sources
    assert shares([2.0]) == [CHUNK]
    assert shares([5, 3, 2], chunk=10) == [5, 3, 2]


@pytest.mark.parametrize("weights", [[0.7, 0.3], [0.6, 0.3, 0.1], [1, 1, 1, 5]])
def test_the_blocks_of_each_source_over_many_steps_match_its_weight_within_a_binomial_bound(weights) -> None:
    """20,000 blocks (many steps of a batch), from a start inside the first chunk: each source's count within 4 sd of
    a binomial draw with p = w_s / Σw (the order is stratified, so it is much closer than that)."""
    n, start = 20_000, 777
    mix = MixtureBlocks([_blocks(50 + 7 * s, s) for s in range(len(weights))], shares(weights), seed=3)
    counts = np.bincount([mix.locate(i)[0] for i in range(start, start + n)], minlength=len(weights))
    for s, w in enumerate(weights):
        p = w / sum(weights)
        bound = 4 * math.sqrt(n * p * (1 - p))
        assert abs(counts[s] - n * p) <= bound, (s, counts[s], n * p, bound)


def test_every_chunk_holds_exactly_each_sources_share_in_a_seeded_order() -> None:
    n = shares([0.6, 0.3, 0.1])
    mix = MixtureBlocks([_blocks(40, s) for s in range(3)], n, seed=0)
    firsts = []
    for c in range(2):
        labels = [mix.locate(i)[0] for i in range(c * CHUNK, (c + 1) * CHUNK)]
        assert np.bincount(labels).tolist() == n
        firsts.append(labels[:64])
    assert firsts[0] != firsts[1]  # shuffled anew in each chunk, not a fixed pattern
    other = MixtureBlocks([_blocks(40, s) for s in range(3)], n, seed=1)
    assert [other.locate(i)[0] for i in range(64)] != firsts[0]


def test_each_source_reads_its_blocks_in_order_of_its_own_count_and_whole_epochs() -> None:
    """The k-th block drawn from source s is its item k (k = 0, 1, 2, ... with no gap or repeat), so every epoch of a
    source is a whole permutation of its blocks, seeded by (seed, epoch) and, after the first source, the source."""
    sources = [_blocks(37, 0), _blocks(11, 1)]
    mix = MixtureBlocks(sources, shares([0.5, 0.5]), seed=5)
    seen: dict[int, list[int]] = {0: [], 1: []}
    for i in range(400):
        s, k = mix.locate(i)
        seen[s].append(k)
        x, y = mix[i]
        assert torch.equal(x, sources[s][k][0]) and torch.equal(y, sources[s][k][1])
    assert seen[0] == list(range(len(seen[0]))) and seen[1] == list(range(len(seen[1])))
    epoch = [sources[1].block_index(k) for k in range(11)]
    assert sorted(epoch) == list(range(11))
    assert TrainBlocks(sources[1].blocks, 0, stream=1).order(0).tolist() != TrainBlocks(sources[1].blocks, 0).order(
        0).tolist()


def test_the_order_is_a_pure_function_of_seed_and_index() -> None:
    """What a resume relies on: item i read cold (another chunk cached, another instance) is item i read in order."""
    make = lambda: MixtureBlocks([_blocks(30, 0), _blocks(20, 1)], shares([0.7, 0.3]), seed=9)  # noqa: E731
    a = make()
    straight = [a.locate(i) for i in range(CHUNK - 50, CHUNK + 50)]
    b = make()
    b.locate(5 * CHUNK)  # another chunk in its cache
    assert [b.locate(i) for i in range(CHUNK + 49, CHUNK - 51, -1)] == straight[::-1]


# --- a mixture of one source is the plain option ---


def test_a_mixture_of_one_source_reads_the_plain_options_tokens_blocks_and_order(tmp_path, styles) -> None:
    plain = TextDataModule({"name": "text_files", "paths": [str(styles["prose"])], "cache_dir": str(tmp_path / "c1"),
                            "batch_size": 4, "val_windows": 6, "val_fraction": 0.1}, seq_len=SEQ, seed=4)
    plain.setup("fit")
    mix = mixture(tmp_path, {"prose": {"paths": [str(styles["prose"])], "weight": 0.25}}, seed=4)
    assert mix.tokenizer_sha256 == plain.tokenizer_sha256 and mix.vocab_size == plain.vocab_size
    assert np.array_equal(np.asarray(mix.val_sets["prose"]), np.asarray(plain.val_blocks))
    for i in list(range(200)) + [10**6 + 3]:
        assert all(torch.equal(a, b) for a, b in zip(mix.train_dataset[i], plain.train_dataset[i])), i


# --- validation per source ---


def test_per_source_val_loss_is_the_mean_loss_over_its_val_blocks_by_hand(tmp_path, styles) -> None:
    """A tiny model validated through Lightning: val/loss/<source> is the mean of the per-block losses over that
    source's validation blocks (6 each, in batches of 4 and 2 that never mix sources), val/loss the mean over all 12
    (token-pooled: every block has the same number of targets); the two styles give different losses."""
    import lightning.pytorch as pl
    from omegaconf import OmegaConf

    from lmlab.config import arch_config
    from lmlab.model.gpt import validate
    from lmlab.run.lit import LitGPT
    from lmlab.run.lit_data import lightning_data

    dm = mixture(tmp_path, {"prose": {"paths": [str(styles["prose"])], "weight": 3},
                            "code": {"paths": [str(styles["code"])], "weight": 1}})
    cfg = compose(["model.n_layer=1", "model.d_model=32", "model.n_head=2", f"model.max_seq_len={SEQ}"])
    torch.manual_seed(0)
    lit = LitGPT(model=validate(arch_config(cfg, vocab_size=dm.vocab_size)).to_dict(),
                 optim=OmegaConf.to_container(cfg.optim, resolve=True),
                 schedule=OmegaConf.to_container(cfg.schedule, resolve=True), max_steps=1)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=dm.callbacks(tmp_path))
    trainer.validate(lit, datamodule=lightning_data(dm), verbose=False)
    logged = {k: float(v) for k, v in trainer.callback_metrics.items()}

    lit.model.eval()
    by_hand, every = {}, []
    with torch.no_grad():
        for name in ("prose", "code"):
            blocks = torch.from_numpy(np.asarray(dm.val_sets[name]).astype(np.int64))
            assert blocks.shape == (6, SEQ + 1)
            losses = [float(lit.model(b[None, :-1], b[None, 1:])) for b in blocks]
            by_hand[name] = sum(losses) / len(losses)
            every += losses
    assert logged["val/loss/prose"] == pytest.approx(by_hand["prose"], rel=1e-5)
    assert logged["val/loss/code"] == pytest.approx(by_hand["code"], rel=1e-5)
    assert logged["val/loss"] == pytest.approx(sum(every) / len(every), rel=1e-5)
    assert abs(by_hand["prose"] - by_hand["code"]) > 1e-3
    assert dm.last == pytest.approx(by_hand, rel=1e-5)  # what summary.json records
    figures = dm.figures()
    assert figures["final_val_loss_by_source"] == dm.last
    assert figures["mixture"]["prose"] == {"name": "text_files", "weight": 3, "fraction": shares([3, 1])[0] / CHUNK,
                                           "train_tokens": len(dm.train_sets["prose"].stream),
                                           "val_blocks": 6}


def test_val_windows_of_another_length_pool_every_source(tmp_path, styles) -> None:
    dm = mixture(tmp_path, {"prose": {"paths": [str(styles["prose"])], "weight": 1},
                            "code": {"paths": [str(styles["code"])], "weight": 1}})
    windows = dm.val_windows(7)
    assert windows.shape == (12, 8)  # 6 windows of each source (data.val_windows)


# --- sources of other kinds ---


def test_a_token_bin_source_shares_the_text_sources_tokenizer(tmp_path, styles) -> None:
    """A tokenizer.json (here a char one) made the .bin source's ids; the text source is tokenized with it, and the
    mixture's blocks of the .bin source are its ids as written."""
    from lmlab.data.tokenizer import save_tokenizer, train_char

    text = (styles["code"] / "code.txt").read_text()
    tok = train_char([text, (styles["prose"] / "a.txt").read_text()], vocab_size=0)
    save_tokenizer(tok, tmp_path / "tok.json")
    ids = np.asarray(tok.encode(text).ids, dtype=np.int64)
    (tmp_path / "bin").mkdir()
    write_shard(tmp_path / "bin" / "train_000.bin", ids[:8000])
    write_shard(tmp_path / "bin" / "val_000.bin", ids[8000:9000])
    sources = {"prose": {"paths": [str(styles["prose"])], "weight": 1},
               "codebin": {"name": "token_bin", "train": str(tmp_path / "bin" / "train_*.bin"),
                           "val": str(tmp_path / "bin" / "val_*.bin"), "val_tokens": 960, "weight": 1}}
    dm = mixture(tmp_path, sources, tokenizer=str(tmp_path / "tok.json"))
    assert dm.vocab_size == tok.get_vocab_size()
    assert np.array_equal(np.asarray(dm.val_sets["codebin"]).ravel(), ids[8000:8000 + 6 * (SEQ + 1)])
    assert np.array_equal(np.asarray(dm.train_sets["codebin"]).ravel(), ids[:8000 // (SEQ + 1) * (SEQ + 1)])
    prose = (styles["prose"] / "a.txt").read_text()
    assert np.asarray(dm.train_sets["prose"][0]).tolist() == tok.encode(prose[:SEQ + 1]).ids
    state = dm.state_dict()
    assert set(state["shards"]) == {"data.sources", "data.sources.prose", "data.sources.codebin"}


def test_a_resume_on_another_source_set_is_refused_naming_it(tmp_path, styles) -> None:
    from lmlab.run.plan import check_same_data

    one = {"prose": {"paths": [str(styles["prose"])], "weight": 1}}
    two = {**one, "code": {"paths": [str(styles["code"])], "weight": 1}}
    a, b = mixture(tmp_path, one), mixture(tmp_path, two)
    saved = {type(a).__qualname__: {**a.state_dict(), "tokenizer_sha256": b.tokenizer_sha256}}  # the sources alone
    with pytest.raises(ValueError, match=r"data\.sources is not the data the checkpoint was trained on"):
        check_same_data("resume=true", b, saved)
    check_same_data("resume=true", a, {type(a).__qualname__: a.state_dict()})  # its own: goes on


# --- refusals, by key, before training ---

GOOD = {"paths": ["/nonexistent/checked/later"], "weight": 1}


@pytest.mark.parametrize("sources,match", [
    ("???", r"data\.sources is required with data=mixture.*\{web: \{paths: \[/a\], weight: 0\.7\}"),
    ({}, r"data\.sources=\{\} names no source"),
    ([GOOD], r"data\.sources must be a mapping of source names"),
    ({"web": {"paths": ["/a"]}}, r"data\.sources\.web\.weight is required: a number > 0"),
    ({"web": {**GOOD, "weight": 0}}, r"data\.sources\.web\.weight=0 must be a number > 0"),
    ({"web": {**GOOD, "weight": -0.5}}, r"data\.sources\.web\.weight=-0\.5 must be a number > 0"),
    ({"web": {**GOOD, "weight": "lots"}}, r"data\.sources\.web\.weight='lots' must be a number > 0"),
    ({"web": {**GOOD, "weight": True}}, r"data\.sources\.web\.weight=True must be a number > 0"),
    ({"web": {**GOOD, "weight": float("nan")}}, r"data\.sources\.web\.weight=nan must be a number > 0"),
    ({"web": {**GOOD, "weight": 1e-9}, "b": GOOD}, r"data\.sources\.web\.weight=1e-09 is too small.*1/65536"),
    ({"a/b": GOOD}, r"data\.sources: 'a/b' is not a valid source name.*val/loss/<name>.*letters, digits"),
    ({"9lives": GOOD}, r"'9lives' is not a valid source name"),
    ({"web": "text"}, r"data\.sources\.web must be a mapping.*name, weight"),
    ({"web": {**GOOD, "name": "mixture"}}, r"data\.sources\.web\.name='mixture' is not a source kind; choose one "
                                           r"of \['hf', 'shakespeare', 'text_files', 'token_bin'\]"),
    ({"web": {**GOOD, "paht": ["/a"]}}, r"data\.sources\.web \(name text_files\) does not take \['paht'\]; it takes "
                                        r"\['name', 'paths', 'weight'\]"),
    ({"web": {"weight": 1}}, r"data\.sources\.web \(name text_files\) needs \['paths'\]"),
    ({"web": {"name": "token_bin", "train": "a*.bin", "weight": 1}}, r"needs \['val'\]"),
    ({"web": {"name": "token_bin", "train": "a", "val": "b", "val_tokens": 0, "weight": 1}},
     r"data\.sources\.web\.val_tokens=0"),
    ({"web": {"name": "token_bin", "train": "a", "val": "b", "weight": 1}},
     r"data\.sources\.web is token_bin.*data\.tokenizer=char.*tokenizer\.json"),
])
def test_bad_sources_are_refused_by_key_with_what_they_take(sources, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_sources({"sources": sources, "tokenizer": "char"})


def test_check_config_refuses_them_before_anything_is_built(tmp_path) -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=r"data\.sources\.code\.weight=0 must be a number > 0"):
        check_config(compose(["data=mixture", "data.sources={web: {paths: [/a], weight: 0.7}, "
                                              "code: {paths: [/b], weight: 0}}"]))
    with pytest.raises(ValueError, match=r"data\.sources is required"):
        check_config(compose(["data=mixture"]))
    check_config(compose(["data=mixture", "data.sources={web: {paths: [/a], weight: 0.7}, code: {paths: [/b], "
                                          "weight: 0.3}}"]))  # the files are the data module's to find


def test_a_source_with_no_files_is_refused_by_its_key(tmp_path, styles) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"data\.sources\.code\.paths=.*the corpus is empty"):
        mixture(tmp_path, {"prose": {"paths": [str(styles["prose"])], "weight": 1},
                           "code": {"paths": [str(tmp_path / "empty")], "weight": 1}})
    with pytest.raises(FileNotFoundError, match=r"data\.sources\.code\.paths: '.*nowhere' does not exist"):
        mixture(tmp_path, {"prose": {"paths": [str(styles["prose"])], "weight": 1},
                           "code": {"paths": [str(tmp_path / "nowhere")], "weight": 1}})
    from lmlab.data.tokenizer import save_tokenizer, train_char

    save_tokenizer(train_char(["abc"], vocab_size=0), tmp_path / "tok.json")
    with pytest.raises(FileNotFoundError, match=r"data\.sources\.b\.train=.*no \.bin shard matches"):
        mixture(tmp_path, {"b": {"name": "token_bin", "train": str(tmp_path / "x*.bin"), "val": "y", "weight": 1}},
                tokenizer=str(tmp_path / "tok.json"))


def test_a_source_too_small_for_a_validation_block_is_refused_naming_it(tmp_path, styles) -> None:
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "t.txt").write_text("a few characters only\n")
    with pytest.raises(ValueError, match=r"data\.sources\.tiny: data\.val_fraction=0\.1 leaves \d+ validation tokens"):
        mixture(tmp_path, {"prose": {"paths": [str(styles["prose"])], "weight": 1},
                           "tiny": {"paths": [str(tmp_path / "tiny")], "weight": 1}})


# --- compare ---


def test_compare_shows_per_source_val_losses_of_the_runs_that_have_them(tmp_path) -> None:
    from lmlab.analysis.compare import compare

    for i, (w, prose, code) in enumerate([(0.7, 2.5, 1.5), (0.3, 2.75, 1.25)]):
        run = tmp_path / "sweep" / str(i)
        run.mkdir(parents=True)
        summary = {"status": "completed", "steps": 8, "final_val_loss": 2.0, "best_val_loss": 2.0,
                   "overrides": [f"data.sources.prose.weight={w}"],
                   "final_val_loss_by_source": {"prose": prose, "code": code}}
        (run / "summary.json").write_text(json.dumps(summary))
    plain = tmp_path / "sweep" / "2"
    plain.mkdir()
    (plain / "summary.json").write_text(json.dumps({"status": "completed", "steps": 8, "final_val_loss": 2.0,
                                                    "overrides": ["data.sources.prose.weight=1"]}))
    _, md = compare(tmp_path / "sweep")
    table = (tmp_path / "sweep" / "compare_sources.md").read_text()
    assert "Validation loss per source" in md and table in md
    assert table.splitlines()[0] == "| data.sources.prose.weight | val/loss | val/loss/code | val/loss/prose |"
    assert table.splitlines()[2:] == ["| 0.3 | 2 | 1.25 | 2.75 |", "| 0.7 | 2 | 1.5 | 2.5 |"]
