"""data.packing=padded (lmlab/data/padded.py): each document cut into its own rows by hand; padded inputs read token
0 and padded targets are ignored; a padded document gives exactly the outputs and loss it has alone (LayerNorm,
RMSNorm), while BatchNorm's batch statistics take the padding in — the source note's argument against it on text;
the data module's rows are the documents' tokens; refusals by key."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.data.padded import IGNORE, PAD, PaddedRows, pad_documents, pair
from lmlab.model.gpt import GPT, validate
from tests.unit.data.test_shards import EOD, dm_for, write_docs
from tests.unit.model.options import assert_refused

E = 99  # the end-of-document id in the hand examples


def test_documents_are_cut_into_padded_rows_by_hand() -> None:
    tokens = np.array([5, 6, E, 7, E, 8, 9, 10, 11, 12, E, 3])
    rows = pad_documents(tokens, 4, E)
    P = PAD
    want = [[5, 6, E, P], [7, E, P, P], [8, 9, 10, 11], [12, E, P, P]]  # the last document, one token, predicts nothing
    assert isinstance(rows, PaddedRows) and rows.tolist() == want
    # a piece of one token (the E after a full piece) is dropped as well
    assert pad_documents(np.array([1, 2, 3, E, 4, 5]), 3, E).tolist() == [[1, 2, 3], [4, 5, P]]
    assert rows.target_counts(100).tolist() == np.bincount([6, E, E, 9, 10, 11, E], minlength=100).tolist()


def test_a_pair_masks_the_padding() -> None:
    x, y = pair(np.array([7, 8, E, PAD, PAD], dtype=np.int32).view(PaddedRows))
    assert x.tolist() == [7, 8, E, 0] and y.tolist() == [8, E, IGNORE, IGNORE]
    x, y = pair(np.array([1, 2, 3], dtype=np.int32).view(PaddedRows))
    assert x.tolist() == [1, 2] and y.tolist() == [2, 3]


def _model(norm: str) -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=40, n_layer=2, d_model=32, n_head=4, max_seq_len=16, norm={"name": norm})
    return GPT(validate(cfg)).double()


@pytest.mark.parametrize("norm", ["layer", "rms"])
def test_a_padded_document_gives_its_outputs_alone(norm: str) -> None:
    """Two documents of 6 and 11 tokens padded to 16 in one batch: each one's logits and loss are those of the
    document by itself (training mode: nothing is dropped)."""
    model = _model(norm).train()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(1, 40, (n,), generator=g) for n in (7, 12)]
    rows = np.full((2, 17), PAD, dtype=np.int32)
    for r, d in enumerate(docs):
        rows[r, :len(d)] = d.numpy()
    xs, ys = zip(*(pair(r) for r in rows.view(PaddedRows)), strict=True)
    x, y = torch.stack(xs), torch.stack(ys)
    logits = model(x)
    total, count = 0.0, 0
    for r, d in enumerate(docs):
        alone = model(d[None, :-1])
        torch.testing.assert_close(logits[r, :len(d) - 1], alone[0], rtol=1e-10, atol=1e-10)
        total += torch.nn.functional.cross_entropy(alone[0], d[1:], reduction="sum").item()
        count += len(d) - 1
    assert model(x, targets=y).item() == pytest.approx(total / count, rel=1e-10)


def test_batchnorm_takes_the_padding_into_its_statistics() -> None:
    """The note's argument: under norm=batch (training mode) the same document's outputs change with the padding its
    batch holds, and in eval mode (running statistics) they differ from training's: it has no 'alone'."""
    model = _model("batch").train()
    d = torch.randint(1, 40, (7,), generator=torch.Generator().manual_seed(2))
    short, long_ = np.full((1, 9), PAD, dtype=np.int32), np.full((1, 17), PAD, dtype=np.int32)
    short[0, :7], long_[0, :7] = d.numpy(), d.numpy()
    a = model(pair(short.view(PaddedRows)[0])[0][None])[0, :6]
    b = model(pair(long_.view(PaddedRows)[0])[0][None])[0, :6]
    alone = model(d[None, :-1])[0]
    assert (a - alone).abs().max() > 1e-3 and (b - a).abs().max() > 1e-3  # more padding, other outputs


def test_the_data_module_rows_are_the_documents(tmp_path: Path) -> None:
    paths = write_docs(tmp_path / "docs", n=30, words=60)
    dm = dm_for(tmp_path, tmp_path / "docs", seq_len=31, eod=EOD, packing="padded")
    eod = dm.eod_id
    docs = [dm.tokenizer.encode(p.read_text()).ids + [eod] for p in sorted(paths)]
    rows = np.asarray(dm.train_dataset.blocks)
    assert rows.shape[1] == 32 and (rows == PAD).any()
    pieces = [r[r != PAD] for r in rows]
    # a row ends its document or is full, but the last: the validation split cuts its document
    assert all(p[-1] == eod or len(p) == 32 for p in pieces[:-1])
    want = []  # the reference, by hand: each document in pieces of 32, one-token pieces left out
    for d in docs:
        want += [d[i: i + 32] for i in range(0, len(d), 32) if len(d[i: i + 32]) >= 2]
    n = len(pieces)
    assert [p.tolist() for p in pieces[:-1]] == want[: n - 1] and n < len(want)  # the rest: validation
    assert pieces[-1].tolist() == want[n - 1][: len(pieces[-1])]
    x, y = dm.train_dataset[0]
    row = rows[dm.train_dataset.block_index(0)]
    n = int((row != PAD).sum())
    assert y[n - 1:].eq(IGNORE).all() and y[: n - 1].ge(0).all() and x[n:].eq(0).all()
    assert dm.unigram_entropy("train") > 0


def test_bad_input_is_refused_by_key(tmp_path: Path) -> None:
    write_docs(tmp_path / "docs", n=3)
    with pytest.raises(ValueError, match=r"data.packing=padded .* data.eod is null"):
        dm_for(tmp_path, tmp_path / "docs", packing="padded")
    with pytest.raises(ValueError, match=r"data.packing.*'packed', 'padded'"):
        dm_for(tmp_path, tmp_path / "docs", packing="pad")
    assert_refused(["data.packing=pad"], r"data.packing")
    assert_refused(["data=mixture", "data.packing=padded", "+data.sources={a: {paths: [/x], weight: 1}}"],
                   r"data.packing=padded is not read by data=mixture")
