"""Token shards (lmlab/data/shards.py): the stream is the documents' tokens in order, whatever the number of
processes, shards or interruptions; the end-of-document token is where documents end; a second job waits for
the first; a prepared corpus is never read again."""

from __future__ import annotations

import codecs
import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lmlab.data import TextDataModule, shards
from lmlab.data import corpus as corpus_module
from lmlab.data.datamodule import train_text, training_sample
from lmlab.data.shards import BlockView, TokenStream, safe_pieces
from lmlab.record.rundir import RunLock

EOD = "<|endoftext|>"
WORDS = ["the", "king", "  queen", "\n", "\n\n", " ", "thou", "art", ",", "—", "é", "\t", "  \n", "42", "😀"]


def write_docs(root: Path, n: int = 12, seed: int = 0, words: int = 400) -> list[Path]:
    """n documents of varied size and whitespace (newlines next to spaces: where a careless cut would differ)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        text = "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(rng.randint(words // 4, words)))
        (path := root / f"doc{i:03d}.txt").write_text(text)
        paths.append(path)
    return paths


def dm_for(tmp_path: Path, root: Path, cache: str = "cache", seq_len: int = 15, **data) -> TextDataModule:
    spec = {"name": "text_files", "paths": [str(root)], "cache_dir": str(tmp_path / cache), "batch_size": 4,
            "val_windows": None, "val_fraction": 0.1, **data}
    dm = TextDataModule(spec, seq_len=seq_len, seed=0)
    dm.setup("fit")
    return dm


def shard_files(dm: TextDataModule) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(dm.shard_dir.iterdir())}


def test_shards_are_the_documents_tokens_in_order(tmp_path: Path) -> None:
    paths = write_docs(tmp_path / "docs")
    for tokenizer in ("char", "bpe"):
        dm = dm_for(tmp_path, tmp_path / "docs", tokenizer=tokenizer, vocab_size=300, shard_size=700)
        index = json.loads((dm.shard_dir / "index.json").read_text())
        assert len(index["shards"]) > 3  # several shards: the stream crosses shard boundaries
        whole = np.concatenate([dm.tokenizer.encode(p.read_text()).ids for p in paths])
        stream = np.concatenate([np.asarray(dm.train_tokens), np.asarray(dm.val_tokens)])
        assert np.array_equal(stream, whole), tokenizer
        # Blocks that straddle shards read the same tokens as the flat stream.
        blocks = np.asarray(dm.train_dataset.blocks)
        assert np.array_equal(blocks.ravel(), whole[: blocks.size])
        assert np.array_equal(dm.train_dataset.blocks[5], whole[5 * 16: 6 * 16])


def test_long_documents_are_cut_only_where_tokenizing_is_unchanged(tmp_path: Path, monkeypatch) -> None:
    """One document far larger than a piece: the BPE ids equal those of the document in one piece."""
    write_docs(tmp_path / "one", n=1, words=6000)
    text = (tmp_path / "one" / "doc000.txt").read_text()
    monkeypatch.setattr(shards, "_PIECE_CHARS", 300)  # pieces of ~300 characters instead of ~4K
    dm = dm_for(tmp_path, tmp_path / "one", tokenizer="bpe", vocab_size=400)
    whole = dm.tokenizer.encode(text).ids
    assert np.array_equal(np.concatenate([np.asarray(dm.train_tokens), np.asarray(dm.val_tokens)]), whole)
    pieces = list(safe_pieces([text[i: i + 97] for i in range(0, len(text), 97)], 300, anywhere=False))
    assert "".join(pieces) == text and len(pieces) > 10
    # A cut after a newline that follows a space would change the tokens: "a  \n" alone ends in one "  \n" token.
    for a, b in zip(pieces, pieces[1:], strict=False):
        assert a.endswith("\n") and not a[-2].isspace() and not b[0].isspace()


def test_one_and_two_processes_write_identical_shards(tmp_path: Path) -> None:
    write_docs(tmp_path / "docs", n=20)
    for tokenizer in ("char", "bpe"):
        one = dm_for(tmp_path, tmp_path / "docs", cache="c1", tokenizer=tokenizer, vocab_size=300, shard_size=500,
                     num_proc=1)
        two = dm_for(tmp_path, tmp_path / "docs", cache="c2", tokenizer=tokenizer, vocab_size=300, shard_size=500,
                     num_proc=2)
        assert len(json.loads((one.shard_dir / "index.json").read_text())["shards"]) > 4
        assert shard_files(one) == shard_files(two), tokenizer


def test_a_resumed_preparation_keeps_finished_shards_and_ends_identical(tmp_path: Path) -> None:
    write_docs(tmp_path / "docs", n=20)
    full = dm_for(tmp_path, tmp_path / "docs", shard_size=500)
    reference = shard_files(full)
    # As a kill leaves it: shards 0-2 complete, shard 3 written but not marked complete, no index.
    shard_dir = full.shard_dir
    n = len(json.loads((shard_dir / "index.json").read_text())["shards"])
    assert n > 5
    (shard_dir / "index.json").unlink()
    kept = {k: (shard_dir / f"shard-{k:05d}.bin").stat().st_mtime_ns for k in range(3)}
    for k in range(3, n):
        for suffix in (".json", ".docs.npy"):
            (shard_dir / f"shard-{k:05d}{suffix}").unlink(missing_ok=True)
        if k > 3:
            (shard_dir / f"shard-{k:05d}.bin").unlink(missing_ok=True)
    (shard_dir / "shard-00003.bin").write_bytes(b"half a shard")
    again = dm_for(tmp_path, tmp_path / "docs", shard_size=500)
    assert shard_files(again) == reference
    assert {k: (shard_dir / f"shard-{k:05d}.bin").stat().st_mtime_ns for k in range(3)} == kept  # not redone


def test_the_end_of_document_token_is_where_documents_end(tmp_path: Path) -> None:
    paths = write_docs(tmp_path / "docs", n=9)
    for tokenizer in ("char", "bpe"):
        dm = dm_for(tmp_path, tmp_path / "docs", tokenizer=tokenizer, vocab_size=300, eod=EOD, shard_size=800)
        eod = dm.tokenizer.token_to_id(EOD)
        assert eod is not None and dm.eod_id == eod and eod < dm.vocab_size
        stream = np.concatenate([np.asarray(dm.train_tokens), np.asarray(dm.val_tokens)])
        lengths = [len(dm.tokenizer.encode(p.read_text()).ids) + 1 for p in paths]
        ends = np.cumsum(lengths) - 1
        assert np.array_equal(np.flatnonzero(stream == eod), ends), tokenizer  # there and only there
        # Each shard records where its documents end.
        index = json.loads((dm.shard_dir / "index.json").read_text())
        offsets, recorded = 0, []
        for shard in index["shards"]:
            recorded += (np.load(dm.shard_dir / shard["file"].replace(".bin", ".docs.npy")) + offsets).tolist()
            offsets += shard["tokens"]
        assert recorded == (ends + 1).tolist() and index["documents"] == len(paths)
    # Without data.eod the documents simply follow each other (the default corpus is unchanged).
    plain = dm_for(tmp_path, tmp_path / "docs")
    plain_stream = np.concatenate([np.asarray(plain.train_tokens), np.asarray(plain.val_tokens)])
    assert plain.eod_id is None and len(plain_stream) == sum(len(p.read_text()) for p in paths)


def test_a_literal_end_of_document_text_is_not_the_token_for_char(tmp_path: Path) -> None:
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text(f"before {EOD} after " * 30)
    dm = dm_for(tmp_path, tmp_path / "d", eod=EOD)
    stream = np.concatenate([np.asarray(dm.train_tokens), np.asarray(dm.val_tokens)])
    assert np.flatnonzero(stream == dm.eod_id).tolist() == [len(stream) - 1]


def test_a_second_job_waits_for_the_first_and_reads_its_shards(tmp_path: Path) -> None:
    write_docs(tmp_path / "docs")
    probe = dm_for(tmp_path, tmp_path / "docs", cache="probe")  # only to learn the shard directory's name
    shard_dir = tmp_path / "cache" / "shards" / probe.shard_dir.name
    done: list[TextDataModule] = []
    with RunLock(shard_dir, wait=True):  # the first job, preparing
        waiter = threading.Thread(target=lambda: done.append(dm_for(tmp_path, tmp_path / "docs")))
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive() and not done  # waiting on the lock, not preparing alongside
    waiter.join(timeout=60)
    assert done and np.array_equal(np.asarray(done[0].train_tokens), np.asarray(probe.train_tokens))


def test_a_prepared_corpus_is_not_read_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = write_docs(tmp_path / "docs")
    first = dm_for(tmp_path, tmp_path / "docs")

    def no_reading(*args, **kwargs):
        raise AssertionError("the corpus was read again")

    monkeypatch.setattr(corpus_module, "_read_pieces", no_reading)
    monkeypatch.setattr(codecs, "getincrementaldecoder", no_reading)  # the fingerprint's streamed hash
    second = dm_for(tmp_path, tmp_path / "docs")
    assert second.shard_dir == first.shard_dir and second.unigram_entropy("train") == first.unigram_entropy("train")
    monkeypatch.undo()
    # A changed file (new content, same size: only the metadata tells) is a new corpus.
    text = paths[0].read_text()
    paths[0].write_text(text[::-1])
    assert dm_for(tmp_path, tmp_path / "docs").shard_dir != first.shard_dir


def test_the_tokenizer_sample_is_the_start_of_the_training_part(tmp_path: Path) -> None:
    for docs in (["abcdefghij", "", "klmnopqrst", "uvwxyz0123"], ["abcdéfghij", "", "klmnöpqrst", "uvw😀yz0123"]):

        def documents():
            return (iter([d[i: i + 3] for i in range(0, len(d), 3)]) for d in docs)  # noqa: B023

        def sample(limit, val_fraction):
            return training_sample(documents(), limit, val_fraction, tmp_path / "sample").texts()

        head = [docs[0], "", docs[2], docs[3][:7]]
        assert sample(None, 0.1) == train_text(docs, 0.1) == head
        assert sample(1000, 0.1) == train_text(docs, 0.1)  # corpus smaller than the sample
        assert sample(12, 0.1) == [docs[0], "", docs[2][:2]]
        assert sample(27, 0.5) == [docs[0], "", docs[2][:5]]  # capped by the split (15 characters)
        assert sample(10, 0.5) == [docs[0], "", ""]  # read up to 20 characters: the next document, none of it taken
        assert sample(11, 0.6) == [docs[0], "", docs[2][:1], ""] and sample(None, 0.99) == []


def test_the_spooled_sample_gives_the_tokenizer_the_list_of_texts_gives(tmp_path: Path) -> None:
    """The sample is read back from disk in pieces (cut only at safe places for BPE): the same fingerprint, hence the
    same cache entry, and a byte-identical tokenizer, as the list of whole texts it stands for."""
    from lmlab.data.tokenizer import Sample, build_tokenizer

    paths = write_docs(tmp_path / "docs", n=6, words=3000)
    texts = [p.read_text() for p in paths]
    with open(tmp_path / "sample", "wb") as f:
        ends = [f.write(t.encode()) for t in texts]
    for kind, vocab in (("char", 0), ("bpe", 300)):
        sample = Sample(tmp_path / "sample", np.cumsum(ends).tolist(), anywhere=kind == "char")
        assert sample.texts() == texts and len(list(sample)) >= len(texts)
        spooled = build_tokenizer(kind, sample, vocab_size=vocab, cache_dir=tmp_path / "a", eod=EOD).to_str()
        listed = build_tokenizer(kind, texts, vocab_size=vocab, cache_dir=tmp_path / "b", eod=EOD).to_str()
        assert spooled == listed
        assert [p.name for p in (tmp_path / "a" / "tokenizers").iterdir()] == [
            p.name for p in (tmp_path / "b" / "tokenizers").iterdir()]
        shutil.rmtree(tmp_path / "a"), shutil.rmtree(tmp_path / "b")


def test_stream_views_and_chunked_counts(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 50, size=n).astype(np.uint16) for n in (7, 0, 30, 1, 64)]
    flat = np.concatenate(parts)
    stream = TokenStream([p for p in parts if len(p)])
    assert len(stream) == len(flat) and np.array_equal(np.asarray(stream), flat)
    view = stream[5:90]
    assert np.array_equal(view.read(3, 40), flat[8:45]) and len(view) == 85
    blocks = BlockView(view, 9)
    assert blocks.shape == (9, 9) and np.array_equal(np.asarray(blocks), flat[5:86].reshape(9, 9))
    assert np.array_equal(np.asarray(blocks[2:5]), flat[5 + 18: 5 + 45].reshape(3, 9))
    expected = np.bincount(flat[5:86].reshape(9, 9)[:, 1:].ravel(), minlength=50)
    assert np.array_equal(blocks.target_counts(50, rows=2), expected)


def test_hf_streaming_reads_the_same_documents(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "hf"))
    write_docs(tmp_path / "docs", n=5)
    rows = dm_for(tmp_path, tmp_path / "docs", name="hf", dataset=str(tmp_path / "docs"), paths=None)
    streamed = dm_for(tmp_path, tmp_path / "docs", name="hf", dataset=str(tmp_path / "docs"), paths=None,
                      streaming=True)
    assert streamed.shard_dir != rows.shard_dir
    assert np.array_equal(np.asarray(streamed.train_tokens), np.asarray(rows.train_tokens))


def test_bad_shard_settings_name_the_key(tmp_path: Path) -> None:
    write_docs(tmp_path / "docs", n=2)
    for key, value, match in (("num_proc", 0, "data.num_proc=0"), ("shard_size", 0, "data.shard_size=0"),
                              ("eod", "", "data.eod=''"), ("tokenizer_sample", 0, "data.tokenizer_sample=0")):
        with pytest.raises(ValueError, match=match):
            dm_for(tmp_path, tmp_path / "docs", **{key: value})


def test_fingerprint_is_of_the_bytes(tmp_path: Path) -> None:
    paths = write_docs(tmp_path / "docs", n=2)
    source = corpus_module.load_text_files(paths=[str(tmp_path / "docs")], cache_dir=tmp_path / "c")
    h = hashlib.sha256()
    for p in paths:
        h.update(p.stat().st_size.to_bytes(8, "little") + p.read_bytes())
    assert source.fingerprint == h.hexdigest()


def test_a_corpus_edited_in_place_with_its_mtime_put_back_is_not_served_stale(tmp_path: Path) -> None:
    """Same path, size, mtime and inode, other bytes: the fingerprint memo is keyed by ctime too, which the kernel
    sets on every change and nobody can set back."""
    (path,) = write_docs(tmp_path / "docs", n=1)
    before = dm_for(tmp_path, tmp_path / "docs")
    st = path.stat()
    text = path.read_text()
    with open(path, "r+", encoding="utf-8") as f:  # in place: the inode stays
        f.write(text[::-1])
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    after_st = path.stat()
    assert (after_st.st_size, after_st.st_mtime_ns, after_st.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    after = dm_for(tmp_path, tmp_path / "docs")
    assert after.corpus_sha256 != before.corpus_sha256 and after.shard_dir != before.shard_dir
    whole = np.asarray(after.tokenizer.encode(text[::-1]).ids)
    assert np.array_equal(np.concatenate([np.asarray(after.train_tokens), np.asarray(after.val_tokens)]), whole)


def test_a_replaced_shard_tokenizer_is_refused_naming_the_directory(tmp_path: Path) -> None:
    write_docs(tmp_path / "docs", n=2)
    dm = dm_for(tmp_path, tmp_path / "docs")
    directory = dm.shard_dir
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    extra = dict(vocab)
    extra["§"] = max(vocab.values()) + 1  # one token more: the ids would decode into other text
    (directory / "tokenizer.json").write_text(json.dumps({**spec, "model": {**spec["model"], "vocab": extra}}))
    with pytest.raises(shards.ShardError, match=rf"{directory}/tokenizer.json is not the tokenizer the shards were "
                                                rf"made with .*remove {directory}"):
        dm_for(tmp_path, tmp_path / "docs")
    index = json.loads((directory / "index.json").read_text())
    del index["tokenizer_sha256"]  # an index of an older lmlab: the vocabulary size is still checked
    (directory / "index.json").write_text(json.dumps(index))
    with pytest.raises(shards.ShardError, match=rf"tokenizer.json has {len(extra)} tokens, the shards' index "
                                                rf"{len(vocab)}"):
        dm_for(tmp_path, tmp_path / "docs")


def test_a_corrupt_index_or_a_truncated_shard_is_refused_with_its_path(tmp_path: Path) -> None:
    write_docs(tmp_path / "docs", n=2)
    directory = dm_for(tmp_path, tmp_path / "docs").shard_dir
    index_text = (directory / "index.json").read_text()
    (directory / "index.json").write_text(index_text[: len(index_text) // 2])
    with pytest.raises(shards.ShardError, match=rf"the shard index {directory}/index.json is corrupt .*rm -r"):
        dm_for(tmp_path, tmp_path / "docs")
    (directory / "index.json").write_text(index_text)
    shard = directory / json.loads(index_text)["shards"][0]["file"]
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(shards.ShardError, match=rf"the token shard {shard} holds \d+ bytes, but its index"):
        dm_for(tmp_path, tmp_path / "docs")


@contextlib.contextmanager
def read_only(directory: Path) -> Iterator[Path]:
    """`directory` as a read-only file system (a read-only bind mount: root writes through file modes), or with
    its write permissions removed where this process cannot mount."""
    view = directory.with_name(directory.name + "_ro")
    view.mkdir()
    mounted = subprocess.run(["mount", "--bind", str(directory), str(view)], capture_output=True).returncode == 0 and \
        subprocess.run(["mount", "-o", "remount,ro,bind", str(view)], capture_output=True).returncode == 0
    if not mounted:
        subprocess.run(["umount", str(view)], capture_output=True)
        if os.geteuid() == 0:
            pytest.skip("root without mount: a read-only cache cannot be made here")
        view.rmdir()
        view = directory
        for p in [directory, *directory.rglob("*")]:
            p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))
    try:
        yield view
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(view)], check=True)  # lazy: the test's memmaps may still be open
        else:
            for p in [directory, *directory.rglob("*")]:
                p.chmod(p.stat().st_mode | stat.S_IWUSR)


def test_a_read_only_cache_serves_a_new_sequence_length(tmp_path: Path) -> None:
    """A shared cache prepared by someone else, read-only here: another model.max_seq_len needs only memos."""
    write_docs(tmp_path / "docs", n=2)
    first = dm_for(tmp_path, tmp_path / "docs", seq_len=15)
    first.unigram_entropy()
    with read_only(tmp_path / "cache") as cache:
        with pytest.raises(OSError):
            (cache / "probe").write_text("x")
        other = dm_for(tmp_path, tmp_path / "docs", cache=cache.name, seq_len=31)
        assert other.shard_dir.parent.parent == cache and other.unigram_entropy() > 0
        assert np.array_equal(np.asarray(other.train_tokens), np.asarray(first.train_tokens))


def _char_tokenizer_json(tmp_path: Path) -> str:
    write_docs(tmp_path / "docs", n=2)
    return dm_for(tmp_path, tmp_path / "docs").tokenizer.to_str()


def test_a_worker_error_names_the_shard_and_its_file(tmp_path: Path) -> None:
    from lmlab.data.corpus import FileUnit

    tok = _char_tokenizer_json(tmp_path)
    (tmp_path / "a.txt").write_text("the king speaks.\n" * 100)
    out = tmp_path / "shards"
    out.mkdir()
    units = [FileUnit([str(tmp_path / "a.txt")]), FileUnit([str(tmp_path / "gone.txt")])]
    with pytest.raises(shards.ShardError, match=rf"shard 1 of {out} \({tmp_path}/gone.txt\) failed: FileNotFoundError"):
        shards.tokenize(units, out, tokenizer_json=tok, eod_id=None, dtype="uint16", num_proc=2)


def _rss_file() -> int:
    """This process's resident file-backed pages (bytes): mapped shards that were read count here."""
    return int(re.search(r"RssFile:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) * 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RssFile from /proc (Linux)")
def test_counting_a_whole_split_keeps_only_a_chunk_of_it_resident(tmp_path: Path) -> None:
    """The unigram count reads every token of the train split once: 1e9 tokens left 2 GB of mapped shard pages in
    the process's RSS (what a cluster's memory limit counts). Each chunk's pages are dropped once counted; the counts
    are the same."""
    tokens = np.random.default_rng(0).integers(0, 500, size=48 << 20, dtype=np.uint16)  # 96 MB in two shards
    for i, part in enumerate(np.split(tokens, 2)):
        part.tofile(tmp_path / f"shard-{i:05d}.bin")
    index = {"dtype": "uint16", "shards": [{"file": f"shard-{i:05d}.bin", "tokens": len(tokens) // 2} for i in (0, 1)]}
    view = BlockView(TokenStream.open(tmp_path, index), 64)
    before = _rss_file()
    counts = view.target_counts(500, rows=1 << 14)  # 2 MB chunks
    assert _rss_file() - before < 16 << 20  # was ~96 MB: every page of both shards
    expected = np.bincount(tokens.reshape(-1, 64)[:, 1:].ravel(), minlength=500)
    assert np.array_equal(counts, expected)


def _traced_peak(fn) -> int:
    """Peak bytes Python and numpy allocate (tracemalloc) while `fn` runs."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_worker_holds_a_few_mb_however_long_the_document(tmp_path: Path) -> None:
    """One document of 24 M characters (two bytes each in Python): the worker tokenizes and writes it a MB at a time.
    It held the whole document and all its ids before (~150 MB here; a 1 GB file, GBs)."""
    from lmlab.data.corpus import FileUnit

    tok = _char_tokenizer_json(tmp_path)
    (tmp_path / "long.txt").write_text("the king — thou art\n" * 1_200_000)
    out = tmp_path / "shards"
    out.mkdir()
    shards._init_worker(tok, None, "uint16", str(out))
    peak = _traced_peak(lambda: shards._write_shard(0, FileUnit([str(tmp_path / "long.txt")])))
    assert peak < 32 << 20, f"{peak / 2**20:.0f} MiB"
    expected = np.asarray(dm_for(tmp_path, tmp_path / "docs").tokenizer.encode("the king — thou art\n").ids * 1_200_000)
    assert np.array_equal(np.fromfile(out / "shard-00000.bin", dtype=np.uint16), expected)


def test_the_tokenizer_sample_is_never_held_in_memory(tmp_path: Path) -> None:
    """The sample (here 20 M characters of one 24 M-character document) goes to disk as it is read and is read back a
    MB at a time to train the tokenizer; the main process held all of it, twice over while joining, before."""
    from lmlab.data.corpus import FileSource
    from lmlab.data.tokenizer import build_tokenizer

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "long.txt").write_text("the king — thou art\n" * 1_200_000)
    source = FileSource([tmp_path / "docs" / "long.txt"], tmp_path / "cache")
    built = []

    def train() -> None:
        sample = training_sample(source.documents(), 20_000_000, 0.1, tmp_path / "sample")
        built.append(build_tokenizer("char", sample, vocab_size=0, cache_dir=tmp_path / "cache"))

    assert (peak := _traced_peak(train)) < 24 << 20, f"{peak / 2**20:.0f} MiB"
    assert (tmp_path / "sample").stat().st_size == len(("the king — thou art\n" * 1_000_000).encode())
    assert built[0].get_vocab_size() == len(set("the king — thou art\n")) + 1  # <unk>
