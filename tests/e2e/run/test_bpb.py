"""Bits per byte through a real run, for the char, a byte-level BPE and the bytes-alone tokenizer (issue 62): val/bpb is
the logged val loss (nats per token) x the validation targets / (ln 2 x the bytes of the raw validation text those
targets cover), the bytes counted here from the corpus' own text (each document tiled by its tokens, an
end-of-document token covering none), not from lmlab's table; train/bpb the same of the step's batch. A corpus with
2-, 3- and 4-byte characters, so the byte-level tokens split characters. A resumed run keeps the bpb of its validations
before the stop; a head that does not predict the next token (head=mlm) has no bpb at all."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from lmlab import compose
from lmlab.model.encoder import IGNORE
from lmlab.run.training import train
from tests.runs import WORDS, metric, metric_rows, one_and_two_ranks, straight_and_resumed, tiny

EOD = "<|endoftext|>"
ACCENTED = "café naïve größe señor €uro 日本 😀".split()
VAL_FRACTION, WINDOWS, SEQ = 0.05, 32, 32  # data.val_fraction (the default), data.val_windows, model.max_seq_len


def _corpus(d: Path) -> Path:
    """~40 kB in 40 documents of ~1 kB (each validation holds a few ends of documents), an accented word in about every
    fourth place."""
    rng = random.Random(1)
    d.mkdir(parents=True, exist_ok=True)
    vocab = WORDS + ACCENTED
    for k in range(40):
        lines = [" ".join(rng.choice(vocab) for _ in range(rng.randint(3, 9))) + "." for _ in range(30)]
        (d / f"doc{k:02d}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return d


def _byte_level_file(path: Path) -> Path:
    """A tokenizer.json of the 256 bytes alone (byte-level BPE, no merges): data.tokenizer=<it>."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))
    return path


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-to-character alphabet, inverted: the byte each character of a byte-level token stands for."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


BYTE = _byte_of_char()


def _pieces(tok: Tokenizer, kind: str, doc: str, eod_id: int | None) -> tuple[list[int], list[bytes]]:
    """A document's token ids (then its end-of-document token, as the data pipeline appends it) and the raw bytes of
    the document each covers, which tile it exactly (checked)."""
    ids = tok.encode(doc).ids
    if kind == "char":  # one token per character of the text: the characters' own bytes
        assert len(ids) == len(doc) and tok.token_to_id("<unk>") not in ids  # every character seen in training
        pieces = [c.encode() for c in doc]
    else:
        pieces = [bytes(BYTE[c] for c in tok.id_to_token(i)) for i in ids]
    assert b"".join(pieces) == doc.encode()
    return (ids + [eod_id], pieces + [b""]) if eod_id is not None else (ids, pieces)


def _token_bytes(tok: Tokenizer, kind: str, ids: torch.Tensor, eod_id: int | None) -> int:
    """The bytes of a batch's targets, each token's own: a character's (char), its bytes (byte-level), none (EOD)."""
    def one(i: int) -> int:
        if i == IGNORE or i == eod_id:
            return 0
        s = tok.id_to_token(i)
        return len(s.encode()) if kind == "char" else len(s)

    return sum(one(i) for i in ids.flatten().tolist())


def _whole(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return False
    return True


class Batches(Callback):
    """Each logged step's targets and its train/loss and train/bpb as Lightning holds them."""

    def __init__(self) -> None:
        self.steps: list[tuple[torch.Tensor, float, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        m = trainer.callback_metrics
        if "train/bpb" in m:
            self.steps.append((batch[1].clone(), float(m["train/loss"]), float(m["train/bpb"])))


KINDS = {"char": ("data.tokenizer=char", f"data.eod='{EOD}'"),
         "bpe": ("data.tokenizer=bpe", "data.vocab_size=300", f"data.eod='{EOD}'"),
         "bytes": ()}


@pytest.mark.e2e
@pytest.mark.parametrize("kind", list(KINDS))
def test_val_bpb_is_the_val_loss_over_the_raw_validation_bytes(tmp_path: Path, kind: str) -> None:
    corpus = _corpus(tmp_path / "corpus")
    extra = KINDS[kind] or (f"data.tokenizer={_byte_level_file(tmp_path / 'bytes.json')}",)
    batches = Batches()
    cfg = compose(tiny(corpus, tmp_path / "cache", *extra, "trainer.max_steps=20", "trainer.val_check_interval=10",
                       "monitor.every_n_steps=0"))
    summary = train(cfg, tmp_path / "run", callbacks=[batches])
    assert summary["status"] == "completed"

    tok = Tokenizer.from_file(str(tmp_path / "run" / "tokenizer.json"))
    eod_id = tok.token_to_id(EOD) if KINDS[kind] else None
    stream_kind = "char" if kind == "char" else "bytes"
    ids, pieces = [], []
    for f in sorted(corpus.glob("*.txt")):  # data=text_files: each file a document, in path order
        i, p = _pieces(tok, stream_kind, f.read_text(encoding="utf-8"), eod_id)
        ids += i
        pieces += p
    cut = int(len(ids) * (1 - VAL_FRACTION))  # the validation split: the stream's last tokens
    windows = min(WINDOWS, (len(ids) - cut) // (SEQ + 1))
    targets = [cut + w * (SEQ + 1) + j for w in range(windows) for j in range(1, SEQ + 1)]  # a window's first: input
    n_bytes = sum(len(pieces[t]) for t in targets)
    assert windows == WINDOWS and len(targets) == WINDOWS * SEQ
    if kind != "char":  # a byte-level token holding part of a character (its bytes alone are not UTF-8)
        assert any(not _whole(pieces[t]) for t in targets)
    if kind != "bytes":
        assert any(ids[t] == eod_id for t in targets)  # an end-of-document token among the targets (no bytes)
    assert (n_bytes == len(targets)) == (kind == "bytes")  # a byte a token for the bytes alone (U+FFFD: 3 a part)

    rows = [r for r in metric_rows(tmp_path / "run").values() if "val/bpb" in r]
    assert len(rows) >= 2
    for r in rows:
        expected = float(r["val/loss"]) * len(targets) / (math.log(2) * n_bytes)
        assert float(r["val/bpb"]) == pytest.approx(expected, rel=1e-6)
    final = summary["final_val_loss"] * len(targets) / (math.log(2) * n_bytes)
    assert summary["final_val_bpb"] == pytest.approx(final, rel=1e-6)
    assert summary["best_val_bpb"] == pytest.approx(min(float(r["val/bpb"]) for r in rows), rel=1e-9)

    assert len(batches.steps) == 20  # trainer.log_every_n_steps=1
    for y, loss, bpb in batches.steps:
        assert bpb == pytest.approx(loss * y.numel() / (math.log(2) * _token_bytes(tok, kind, y, eod_id)), rel=1e-6)


@pytest.mark.e2e
def test_a_head_that_does_not_predict_the_next_token_has_no_bpb(tmp_path: Path) -> None:
    corpus = _corpus(tmp_path / "corpus")
    summary = train(compose(tiny(corpus, tmp_path / "cache", "head=mlm", "position=rope", "trainer.max_steps=10",
                                 "monitor.every_n_steps=0")), tmp_path / "run")
    assert summary["status"] == "completed" and summary["final_val_loss"] is not None
    assert "final_val_bpb" not in summary and "best_val_bpb" not in summary
    header = (tmp_path / "run" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "val/loss" in header and "val/bpb" not in header and "train/bpb" not in header


@pytest.mark.e2e
def test_a_resumed_run_keeps_its_bpb_history(tmp_path: Path) -> None:
    """Stopped at step 17 and resumed: the validation at step 10, before the stop, stays in the run's bpb history (its
    checkpoint's, what best_val_bpb is the minimum of), and every figure equals the straight run's."""
    straight, resumed = straight_and_resumed(_corpus(tmp_path / "corpus"), tmp_path, "monitor.every_n_steps=0")
    histories = [torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["lmlab"]["val_bpb_history"]
                 for run in (straight, resumed)]
    assert [step for step, _ in histories[0]] == [step for step, _ in histories[1]] == [10, 20, 30]
    assert [bpb for _, bpb in histories[1]] == pytest.approx([bpb for _, bpb in histories[0]], rel=1e-6)
    summaries = [json.loads((run / "summary.json").read_text()) for run in (straight, resumed)]
    for key in ("final_val_bpb", "best_val_bpb"):
        assert summaries[1][key] == pytest.approx(summaries[0][key], rel=1e-6)
    assert summaries[0]["best_val_bpb"] == min(bpb for _, bpb in histories[0])


@pytest.mark.e2e
def test_two_ddp_ranks_give_the_one_process_bpb(tmp_path: Path) -> None:
    """One process x batch 8 against 2 ranks x batch 4 on the same global batches: train/bpb is the global batch's, its
    ranks' nats over their bytes (a rank's own half has other bytes per token), val/bpb the same validation's. Compared
    as bpb / loss, the batch's tokens / (ln 2 x its bytes): a function of the batch alone, whatever the numerics."""
    args = [a for a in tiny(_corpus(tmp_path / "corpus"), tmp_path / "cache", *KINDS["bpe"], "trainer.max_steps=10",
                            "monitor.every_n_steps=0", "logger=csv") if not a.startswith("data.batch")]
    one, two = one_and_two_ranks(args, tmp_path)
    for split in ("train", "val"):
        ratios = [{step: metric(run, f"{split}/bpb")[step] / loss
                   for step, loss in metric(run, f"{split}/loss").items()} for run in (one, two)]
        assert ratios[0].keys() == ratios[1].keys() and len(ratios[0]) >= (10 if split == "train" else 1), split
        assert list(ratios[1].values()) == pytest.approx(list(ratios[0].values()), rel=1e-6), split
    assert len(set(ratios[0].values())) == 1  # (val: the same windows at every validation)
