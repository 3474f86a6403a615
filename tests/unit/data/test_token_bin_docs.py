"""Documents on data=token_bin: the separator id (`data.doc_sep`) opens each document (`data.doc_sep_role=bos`, the
speedrun's shards: [50256, *document]) or ends each (`eod`). The documents are numbered so that a BOS belongs to the
document it opens and an EOD to the one it ends; positions per document restart there; with attention.doc_mask a
document packed among others gives exactly its logits alone, under either role, GPT-2's id and a small vocabulary
alike (and read under the other role, not: the boundary one token off shows). The model records the role, so a
resume under the other is refused; a separator outside the vocabulary is refused naming its key."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig, arch_config
from lmlab.data.token_bin import TokenBinDataModule, write_shard
from lmlab.model.attention.cache import KVCache
from lmlab.model.mask import doc_positions, documents
from lmlab.model.gpt import GPT, validate

TOL = dict(rtol=1e-5, atol=1e-5)
S = 9  # the separator of the small-vocabulary tests


def test_a_bos_opens_its_document_and_an_eod_ends_its_own() -> None:
    idx = torch.tensor([[S, 1, 2, 3, S, 4, 5], [6, 7, S, 1, S, S, 2]])
    assert documents(idx, S, opens=True).tolist() == [[1, 1, 1, 1, 2, 2, 2], [0, 0, 1, 1, 2, 3, 3]]
    assert documents(idx, S).tolist() == [[0, 1, 1, 1, 1, 2, 2], [0, 0, 0, 1, 1, 2, 3]]  # EOD: as before
    # continued after a cache whose next token is in document 4: a BOS opens 5 at once, an EOD only after it
    assert documents(idx[:, :2], S, torch.tensor([4, 4]), opens=True).tolist() == [[5, 5], [4, 4]]
    assert documents(idx[:, :2], S, torch.tensor([4, 4])).tolist() == [[4, 5], [4, 4]]


def test_positions_per_document_restart_at_the_bos_and_after_the_eod() -> None:
    bos = torch.tensor([[7, S, 1, 2, 3, S, 4, 5]])
    assert doc_positions(documents(bos, S, opens=True), 8).tolist() == [[0, 0, 1, 2, 3, 0, 1, 2]]
    eod = torch.tensor([[1, 2, 3, S, 4, 5, S, 6]])
    assert doc_positions(documents(eod, S), 8).tolist() == [[0, 1, 2, 3, 0, 1, 2, 0]]


def _model(vocab: int, sep: int, role: str, **kw) -> GPT:
    base = dict(vocab_size=vocab, n_layer=2, d_model=32, n_head=4, max_seq_len=32, position={"name": "rope"},
                eod_id=sep, doc_sep_role=role, attention={"name": "mha", "doc_mask": True})
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(**{**base, **kw}))).eval()
    with torch.no_grad():  # sharp attention: at init it is nearly uniform and hides mistakes
        for name, p in model.named_parameters():
            if name.endswith("attn.c_attn.weight"):
                p.mul_(10)
    return model


def _packed(sep: int, role: str) -> list[list[int]]:
    """Three documents as a packed block holds them: the tail of one cut by the block's start, two whole ones."""
    a, b, c = [11, 12], [13, 14, 15], [16, 17]
    if role == "bos":  # [50256, *document], as the speedrun's shards are written
        return [a, [sep, *b], [sep, *c]]
    return [[*a, sep], [*b, sep], c]


VOCABS = [(50257, 50256), (30, S)]  # GPT-2's vocabulary and <|endoftext|>, and a small one


@pytest.mark.parametrize("vocab,sep", VOCABS)
@pytest.mark.parametrize("role", ["bos", "eod"])
@pytest.mark.parametrize("extra", [{}, {"position": {"name": "learned", "per_document": True}}],
                         ids=["rope", "learned_per_document"])
def test_a_packed_document_gives_its_outputs_alone_under_either_role(vocab, sep, role, extra) -> None:
    """e.g. BOS: [11, 12, 50256, 13, 14, 15, 50256, 16, 17]: the logits of each of the three documents inside the
    block are those of the document run alone. Read under the other role (the separator given to the wrong
    document) or without the mask, they are not."""
    docs = _packed(sep, role)
    packed = torch.tensor([sum(docs, [])])
    model = _model(vocab, sep, role, **extra)
    with torch.no_grad():
        out, start = model(packed), 0
        for doc in docs:
            torch.testing.assert_close(out[:, start:start + len(doc)], model(torch.tensor([doc])), **TOL)
            start += len(doc)
        for other in (_model(vocab, sep, "eod" if role == "bos" else "bos", **extra),
                      _model(vocab, sep, role, **extra, attention={"name": "mha"})):
            b = slice(len(docs[0]), len(docs[0]) + len(docs[1]))
            assert not torch.allclose(other(packed)[:, b], other(torch.tensor([docs[1]])), **TOL)


def test_the_kv_cache_numbers_bos_documents_as_the_full_forward() -> None:
    """Token by token through the cache (documents opening mid-prompt and mid-generation, two BOS in a row) the
    logits are the full forward's, for the doc mask and for positions per document."""
    idx = torch.tensor([[5, 6, S, 7, 8, 9, S, 10, 11, S, S, 12, 13, 14, 15, 16],
                        [S, 5, 5, 5, 6, S, 7, 8, 9, 10, 11, 12, 13, S, 14, 15]])
    for kw in ({}, {"position": {"name": "learned", "per_document": True}, "attention": {"name": "mha"}}):
        model = _model(30, S, "bos", **kw)
        with torch.no_grad():
            full, cache = model(idx), KVCache(2)
            steps = [model(idx[:, :6], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(6, 16)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def _bin_cfg(*extra: str):
    return compose(["data=token_bin", "data.train=x", "data.val=y", "attention.doc_mask=true", *extra])


def test_the_model_records_the_separator_and_its_role_and_a_resume_under_the_other_is_refused() -> None:
    from lmlab.run.checks import check_config
    from lmlab.run.plan import check_same_arch

    cfg = _bin_cfg("data.doc_sep=50256")
    check_config(cfg)  # before any data: the separator comes from data.doc_sep
    bos = arch_config(cfg, vocab_size=50257)
    assert (bos.eod_id, bos.doc_sep_role) == (50256, "bos")  # the format's default role
    eod = arch_config(_bin_cfg("data.doc_sep=50256", "data.doc_sep_role=eod"), vocab_size=50257)
    assert eod.doc_sep_role == "eod"
    with pytest.raises(ValueError, match=r"model/doc_sep_role: checkpoint has 'bos', config has 'eod'"):
        check_same_arch("resume=true (last.ckpt)", eod.to_dict(), bos.to_dict())
    old = {k: v for k, v in bos.to_dict().items() if k != "doc_sep_role"}  # a record from before the role: eod
    check_same_arch("resume", arch_config(compose(["attention.doc_mask=true"]), 50257, eod_id=50256).to_dict(), old)
    with pytest.raises(ValueError, match=r"data.doc_sep_role='start' must be one of \['eod', 'bos'\]"):
        check_config(_bin_cfg("data.doc_sep=50256", "data.doc_sep_role=start"))
    plain = arch_config(compose(["data=token_bin", "data.train=x", "data.val=y", "data.doc_sep=5"]), 64)
    assert plain.eod_id is None  # no doc mask, no positions per document: the model needs no documents


def _spec(d: Path, **kw) -> dict:
    return {"name": "token_bin", "train": str(d / "train_*.bin"), "val": str(d / "val_*.bin"), "val_tokens": 66,
            "vocab_size": 64, **kw}


def test_the_data_module_gives_the_separator_and_refuses_one_outside_the_vocabulary(tmp_path, caplog) -> None:
    d = tmp_path / "shards"
    d.mkdir()
    docs = [[S, *np.random.default_rng(i).integers(10, 64, 5 + i % 7)] for i in range(40)]
    write_shard(d / "train_0.bin", np.concatenate(docs))
    write_shard(d / "val_0.bin", np.concatenate(docs[::-1]))
    data = TokenBinDataModule(_spec(d, doc_sep=S), seq_len=32, seed=0)
    assert (data.eod_id, data.doc_sep_role) == (S, "bos")
    assert TokenBinDataModule(_spec(d), seq_len=32, seed=0).eod_id is None  # no documents unless asked
    with pytest.raises(ValueError, match=r"data.doc_sep=64 is not a token of the vocabulary \(ids below "
                                         r"data.vocab_size=64\)"):
        TokenBinDataModule(_spec(d, doc_sep=64), seq_len=32, seed=0)
    with pytest.raises(ValueError, match=r"data.doc_sep=50256 is not a token of the vocabulary"):
        TokenBinDataModule(_spec(d, doc_sep=50256, vocab_size=50000), seq_len=32, seed=0)
    with pytest.raises(ValueError, match=r"data.doc_sep_role='start' must be one of"):
        TokenBinDataModule(_spec(d, doc_sep=S, doc_sep_role="start"), seq_len=32, seed=0)
    with pytest.raises(ValueError, match=r"data.doc_sep=-1 must be an integer >= 0"):
        TokenBinDataModule(_spec(d, doc_sep=-1), seq_len=32, seed=0)
    with pytest.raises(ValueError, match=r"does not take \['data.eod'\] \(its documents' separator is an id: "
                                         r"data.doc_sep"):
        TokenBinDataModule(_spec(d, eod="<|endoftext|>"), seq_len=32, seed=0)
    data.setup()  # the separator is in the val tokens: nothing said
    with caplog.at_level(logging.WARNING, logger="lmlab.data.token_bin"):
        TokenBinDataModule(_spec(d, doc_sep=8), seq_len=32, seed=0).setup()
    assert "data.doc_sep=8 never occurs in the 66 val tokens" in caplog.text


@pytest.mark.parametrize("role", ["bos", "eod"])
def test_align_docs_starts_every_training_block_at_a_document_and_skips_the_fewest_tokens(tmp_path, role) -> None:
    """data.align_docs (record 26): each block opens a document (at a BOS; after an EOD), the next block starts at
    the first document start at least max_seq_len tokens on (the record's rule, by hand below), and whole blocks
    only; the validation blocks stay the fixed, unaligned ones."""
    d = tmp_path / "shards"
    d.mkdir()
    rng = np.random.default_rng(0)
    docs = [list(rng.integers(10, 64, 3 + i % 11)) for i in range(60)]
    stream = np.concatenate([[S, *doc] if role == "bos" else [*doc, S] for doc in docs])
    write_shard(d / "train_0.bin", stream)
    write_shard(d / "val_0.bin", stream[::-1].copy())
    L = 16
    data = TokenBinDataModule(_spec(d, doc_sep=S, doc_sep_role=role, align_docs=True), seq_len=L, seed=0)
    data.setup()
    seps = np.flatnonzero(stream == S)
    starts = seps if role == "bos" else seps + 1
    want, s = [], starts[0]
    while s + L + 1 <= len(stream):  # by hand: accept s, then the first start at or past s + L
        want.append(s)
        later = starts[starts >= s + L]
        if not len(later):
            break
        s = later[0]
    blocks = data.train_dataset.blocks
    assert blocks.starts.tolist() == want and len(want) > 5
    for i, a in enumerate(want):
        block = np.asarray(blocks[i])
        assert block.tolist() == stream[a:a + L + 1].tolist()
        assert block[0] == S if role == "bos" else stream[a - 1] == S
    unaligned = TokenBinDataModule(_spec(d, doc_sep=S, doc_sep_role=role), seq_len=L, seed=0)
    unaligned.setup()
    assert np.array_equal(np.asarray(data.val_blocks), np.asarray(unaligned.val_blocks))


def test_align_docs_without_a_separator_is_refused_naming_the_keys(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"data.align_docs=true .* data.doc_sep, which is null"):
        TokenBinDataModule(_spec(tmp_path, align_docs=True), seq_len=16, seed=0)
