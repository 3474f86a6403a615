"""data=token_bin: .bin shards in the nanoGPT/llm.c layout round-trip, the header is checked (bad magic, wrong
version, truncated refused by path), validation is the first val_tokens tokens, and a run trains on them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab.data.token_bin import (
    HEADER_BYTES,
    MAGIC,
    TokenBinDataModule,
    TokenBinError,
    open_shards,
    read_header,
    write_shard,
)


def _shards(d: Path, n_train: int = 3, tokens: int = 5000, vocab: int = 300, counting: bool = False) -> Path:
    """Train shards of random ids (or counting 0, 1, ..., vocab − 1 from shard i's offset), a counting val shard."""
    rng = np.random.default_rng(0)
    d.mkdir(parents=True, exist_ok=True)
    for i in range(n_train):
        ids = (np.arange(tokens) + 7 * i) % vocab if counting else rng.integers(0, vocab, tokens)
        write_shard(d / f"fineweb_train_{i:06d}.bin", ids)
    write_shard(d / "fineweb_val_000000.bin", np.arange(tokens) % vocab)
    return d


def test_the_layout_is_llm_c_s(tmp_path: Path) -> None:
    tokens = np.array([50256, 0, 1, 65535, 42], dtype=np.int64)
    path = write_shard(tmp_path / "a.bin", tokens)
    raw = path.read_bytes()
    assert len(raw) == 256 * 4 + 2 * 5
    header = np.frombuffer(raw[:1024], dtype="<i4")
    assert header[0] == 20240520 == MAGIC and header[1] == 1 and header[2] == 5 and not header[3:].any()
    assert np.frombuffer(raw[1024:], dtype="<u2").tolist() == tokens.tolist()  # little-endian uint16, no padding
    assert read_header(path) == 5
    stream = open_shards(str(tmp_path / "*.bin"), "data.train")
    assert stream.read(0, 5).tolist() == tokens.tolist()
    with pytest.raises(ValueError, match="uint16"):
        write_shard(tmp_path / "b.bin", [70000])


@pytest.mark.parametrize("damage, match", [
    (lambda raw: np.int32(20240521).tobytes() + raw[4:], r"magic number 20240521 is not 20240520"),
    (lambda raw: raw[:4] + np.int32(2).tobytes() + raw[8:], r"version 2; lmlab reads version 1"),
    (lambda raw: raw[:-2], r"truncated .bin shard: the header gives 100 tokens \(1224 bytes\), the file has 1222"),
    (lambda raw: raw[:100], r"truncated .bin shard \(100 bytes, less than the 1024-byte header\)"),
])
def test_a_bad_header_is_refused_by_path(tmp_path: Path, damage, match) -> None:
    path = write_shard(tmp_path / "bad.bin", np.arange(100))
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(TokenBinError, match=match) as err:
        read_header(path)
    assert str(path) in str(err.value)


def test_validation_is_the_first_val_tokens_and_training_reads_every_shard(tmp_path: Path) -> None:
    d = _shards(tmp_path / "shards")
    data = TokenBinDataModule({"name": "token_bin", "train": str(d / "fineweb_train_*.bin"),
                               "val": str(d / "fineweb_val_*.bin"), "val_tokens": 330, "vocab_size": 300,
                               "batch_size": 4}, seq_len=32, seed=1)
    data.setup()
    assert len(data.train_tokens) == 15000 and len(data.val_tokens) == 330
    assert len(data.val_blocks) == 330 // 33 == 10  # the first 330 tokens, cut into blocks of 33
    x, y = next(iter(data.val_dataloader()))
    assert x.shape == (4, 32) and x[0].tolist() == list(range(32)) and y[0].tolist() == list(range(1, 33))
    first = torch.cat([b[0] for b in data.val_dataloader()])
    assert first.shape == (10, 32)
    seen = {int(data.train_dataset.block_index(i)) for i in range(len(data.train_dataset.blocks))}
    assert seen == set(range(15000 // 33))  # an epoch visits every block of the three shards once
    counts = np.bincount(np.arange(330) % 300, minlength=300)[np.bincount(np.arange(330) % 300) > 0]
    p = counts / counts.sum()
    assert data.unigram_entropy("val") == pytest.approx(float(-(p * np.log(p)).sum()))
    big = TokenBinDataModule({"name": "token_bin", "train": str(d / "fineweb_train_*.bin"),
                              "val": str(d / "fineweb_val_*.bin"), "vocab_size": 100}, seq_len=32, seed=1)
    with pytest.raises(ValueError, match=r"data.val_tokens=10485760: the val shards .* hold only 5000 tokens"):
        big.setup()
    small_vocab = TokenBinDataModule({"name": "token_bin", "train": str(d / "fineweb_train_*.bin"),
                                      "val": str(d / "fineweb_val_*.bin"), "val_tokens": 330, "vocab_size": 100},
                                     seq_len=32, seed=1)
    with pytest.raises(ValueError, match=r"data.val: the shards hold token id \d+, not below data.vocab_size=100"):
        small_vocab.setup()
    with pytest.raises(FileNotFoundError, match="data.train=.*nothing_\\*.bin: no .bin shard matches"):
        TokenBinDataModule({"name": "token_bin", "train": str(d / "nothing_*.bin"), "val": str(d / "*val*.bin"),
                            "val_tokens": 330}, seq_len=32, seed=1).setup()
    with pytest.raises(ValueError, match=r"does not take \['data.val_fraction'\]"):
        TokenBinDataModule({"name": "token_bin", "train": "a", "val": "b", "val_fraction": 0.1}, seq_len=32, seed=1)
    assert HEADER_BYTES == 1024


def test_every_train_id_is_checked_against_the_vocabulary_once_per_shard(tmp_path: Path, monkeypatch) -> None:
    """Only the first 10M train tokens were checked: a bad id past them was a raw IndexError in training. Each
    shard's largest id is read once (memory-mapped, in chunks) and remembered by its path, size and mtime."""
    monkeypatch.setenv("LMLAB_CACHE", str(tmp_path / "cache"))
    d = tmp_path / "shards"
    d.mkdir()
    write_shard(d / "fineweb_train_000000.bin", np.zeros(10_000_001, dtype=np.uint16))
    write_shard(d / "fineweb_train_000001.bin", [1, 2, 3, 299, 4])
    write_shard(d / "fineweb_val_000000.bin", np.arange(400) % 50)
    spec = {"name": "token_bin", "train": str(d / "fineweb_train_*.bin"), "val": str(d / "fineweb_val_*.bin"),
            "val_tokens": 330, "vocab_size": 100}
    with pytest.raises(ValueError, match=r"data.train: .*fineweb_train_000001.bin holds token id 299, not below "
                                         r"data.vocab_size=100"):
        TokenBinDataModule(spec, seq_len=32, seed=1).setup()
    assert len(list((tmp_path / "cache" / "token_bin_shards").glob("*.json"))) == 2  # one memo per shard
    TokenBinDataModule({**spec, "vocab_size": 300}, seq_len=32, seed=1).setup()  # the memos answer
    write_shard(d / "fineweb_train_000001.bin", [1, 2, 3, 4])  # rewritten: read again, not the old memo
    TokenBinDataModule(spec, seq_len=32, seed=1).setup()


def test_val_tokens_0_and_a_glob_matching_a_directory_are_refused(tmp_path: Path) -> None:
    """data.val_tokens=0 silently meant the speedrun's 10,485,760; a glob matching a directory was a raw
    IsADirectoryError."""
    d = _shards(tmp_path / "shards")
    spec = {"name": "token_bin", "train": str(d / "fineweb_train_*.bin"), "val": str(d / "fineweb_val_*.bin")}
    with pytest.raises(ValueError, match=r"data.val_tokens=0 is less than one block"):
        TokenBinDataModule({**spec, "val_tokens": 0}, seq_len=32, seed=1)
    (d / "fineweb_train_dir.bin").mkdir()
    with pytest.raises(TokenBinError, match=r"data.train=.* matches the directory .*fineweb_train_dir.bin: the glob "
                                            r"must match .bin shard files"):
        TokenBinDataModule({**spec, "val_tokens": 330}, seq_len=32, seed=1).setup()
