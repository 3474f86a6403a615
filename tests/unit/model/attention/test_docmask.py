"""Document masking (attention.doc_mask): in a packed block each token reads only the earlier tokens of its own
document. The documents are numbered from the end-of-document tokens; every path (SDPA, the banded window, the
explicit scores) is checked against a mask built by hand token by token over documents of random lengths; a RoPE
model's outputs on a document inside a packed block are its outputs on that document alone; the KV cache gives the
full forward's logits; a run trains and evaluates with it."""

from __future__ import annotations

import random

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.mask import documents, key_counts
from lmlab.model.attention.score import SCORES, attend
from lmlab.model.gpt import GPT, validate
from lmlab.model.position import POSITIONS

TOL = dict(rtol=1e-5, atol=1e-5)
E = 3  # the end-of-document token of these tests


def test_documents_are_numbered_from_their_end_tokens() -> None:
    idx = torch.tensor([[5, E, 3 + 4, 4, E, E, 7], [E, 1, 2, 2, 2, 2, E]])
    assert documents(idx, E).tolist() == [[0, 0, 1, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1, 1]]
    # after a cache whose next token starts document 4 (row 0) and 2 (row 1)
    assert documents(idx[:, :3], E, torch.tensor([4, 2])).tolist() == [[4, 4, 5], [2, 3, 3]]


def test_a_query_counts_the_keys_of_its_own_document() -> None:
    doc = torch.tensor([[0, 0, 1, 1, 1, 2, 3, 3]])
    assert key_counts(8, 0, torch.device("cpu"), None, doc).tolist() == [[1, 2, 1, 2, 3, 1, 1, 2]]
    assert key_counts(8, 0, torch.device("cpu"), 2, doc).tolist() == [[1, 2, 1, 2, 2, 1, 1, 2]]
    assert key_counts(3, 5, torch.device("cpu"), None, doc).tolist() == [[1, 1, 2]]  # the last 3 of 8 positions


def _random_docs(B: int, N: int, rng: random.Random) -> torch.Tensor:
    """(B, N) document numbers of documents of random lengths (1 to 6 tokens)."""
    rows = []
    for _ in range(B):
        row, d = [], 0
        while len(row) < N:
            row += [d] * rng.randint(1, 6)
            d += 1
        rows.append(row[:N])
    return torch.tensor(rows)


def _reference(q, k, v, scale, offset, window, doc, score="softmax", bias=None):
    """Each query's output from the keys it may read, listed one by one: same document, not later, within the
    window; softmax over them (relu2: relu² / their count)."""
    B, h, T, _ = q.shape
    S = k.size(-2)
    k = k.repeat_interleave(h // k.size(1), dim=1)
    v = v.repeat_interleave(h // v.size(1), dim=1)
    out = torch.zeros_like(q)
    first = offset + T - S
    for b in range(B):
        for i in range(T):
            p = offset + i
            keys = [j for j in range(S) if first + j <= p and doc[b, first + j] == doc[b, p]
                    and (window is None or p - (first + j) < window)]
            logits = torch.einsum("hd,hnd->hn", q[b, :, i], k[b, :, keys]) * scale
            if bias is not None:
                logits = logits + bias[:, i, keys]
            w = logits.softmax(-1) if score == "softmax" else torch.relu(logits) ** 2 / len(keys)
            out[b, :, i] = torch.einsum("hn,hnd->hd", w, v[b, :, keys])
    return out


# (queries T, cached positions before them, keys S, window): a full context, a cache, a window's trimmed cache
CASES = [(7, 0, 7, None), (7, 5, 12, None), (7, 0, 7, 3), (7, 5, 12, 3), (7, 5, 9, 3), (7, 9, 13, 7), (1, 9, 6, 6)]


@pytest.mark.parametrize("T,offset,S,window", CASES)
@pytest.mark.parametrize("score", ["softmax", "relu2"])
def test_every_path_masks_documents_as_built_by_hand(T, offset, S, window, score) -> None:
    rng = random.Random(offset * 31 + S)
    torch.manual_seed(offset + S)
    doc = _random_docs(2, offset + T, rng)
    q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 2, S, 8), torch.randn(2, 2, S, 8)
    docs = (doc[:, offset:], doc[:, offset + T - S:])
    nope = POSITIONS["none"](16, 8, 4, 64, 64, {"name": "none"})
    out = attend(q, k, v, SCORES[score](64), 0.4, nope, offset, window=window, doc=docs)
    torch.testing.assert_close(out, _reference(q, k, v, 0.4, offset, window, doc, score), **TOL)


def test_documents_mask_under_alibi_too() -> None:
    torch.manual_seed(5)
    T, doc = 9, _random_docs(1, 9, random.Random(5))
    pos = POSITIONS["alibi"](16, 8, 2, 64, 64, {"name": "none"})
    q, k, v = (torch.randn(1, 2, T, 8) for _ in range(3))
    bias = pos.attn_bias(T, q.device, q.dtype, 0)
    out = attend(q, k, v, SCORES["softmax"](64), 0.5, pos, 0, doc=(doc, doc))
    torch.testing.assert_close(out, _reference(q, k, v, 0.5, 0, None, doc, bias=bias), **TOL)


def _model(**kw) -> GPT:
    base = dict(vocab_size=30, n_layer=2, d_model=32, n_head=4, max_seq_len=32, position={"name": "rope"},
                eod_id=E, attention={"name": "mha", "doc_mask": True})
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(**{**base, **kw}))).eval()
    with torch.no_grad():  # sharp attention: at init it is nearly uniform and hides mistakes
        for name, p in model.named_parameters():
            if name.endswith("attn.c_attn.weight"):
                p.mul_(10)
    return model


@pytest.mark.parametrize("attention", [{"name": "mha", "doc_mask": True},
                                       {"name": "gqa", "doc_mask": True, "window": 4},
                                       {"name": "mha", "doc_mask": True, "score": "relu2"}])
def test_a_document_in_a_packed_block_reads_as_the_document_alone(attention) -> None:
    """RoPE attends by relative position, so with documents masked the outputs on document B inside [A, EOD, B, EOD,
    C] are B's outputs alone (and without the mask they are not)."""
    a, b, c = [5, 6, 7, 8, 9, E], [10, 11, 12, 13, 14, 15, 16, E], [17, 18, 19]
    packed = torch.tensor([a + b + c])
    kw = {"attention": attention, "n_kv_head": 2 if attention["name"] == "gqa" else None}
    model = _model(**kw)
    with torch.no_grad():
        inside = model(packed)[:, len(a):len(a) + len(b)]
        alone = model(torch.tensor([b]))
    torch.testing.assert_close(inside, alone, **TOL)
    unmasked = _model(**{**kw, "attention": {**attention, "doc_mask": False}})
    with torch.no_grad():
        assert not torch.allclose(unmasked(packed)[:, len(a):len(a) + len(b)], unmasked(torch.tensor([b])), **TOL)


def test_the_kv_cache_masks_documents_as_the_full_forward() -> None:
    """Token by token through the cache (documents ending mid-prompt and mid-generation) the logits are the full
    forward's; a windowed layer's trimmed cache too."""
    idx = torch.tensor([[5, 6, E, 7, 8, 9, E, 10, 11, E, E, 12, 13, 14, 15, 16],
                        [E, 5, 5, 5, 6, E, 7, 8, 9, 10, 11, 12, 13, E, 14, 15]])
    for attention in ({"name": "mha", "doc_mask": True}, {"name": "mha", "doc_mask": True, "window": 3,
                                                          "pattern": ["local", "global"]}):
        model = _model(attention=attention)
        with torch.no_grad():
            full = model(idx)
            cache = KVCache(2)
            steps = [model(idx[:, :5], cache=cache)]
            steps += [model(idx[:, t:t + 1], cache=cache) for t in range(5, idx.size(1))]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def test_document_masking_without_an_end_of_document_token_is_refused_by_key() -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=r"attention.doc_mask=true needs an end-of-document token .* set data.eod"):
        check_config(compose(["attention.doc_mask=true"]))
    check_config(compose(["attention.doc_mask=true", "data.eod='<|endoftext|>'"]))  # with one: accepted


def test_positions_restart_at_each_document() -> None:
    from lmlab.model.mask import doc_positions

    doc = torch.tensor([[0, 0, 1, 1, 1, 2, 3, 3]])
    assert doc_positions(doc, 8).tolist() == [[0, 1, 0, 1, 2, 0, 0, 1]]
    assert doc_positions(doc, 3).tolist() == [[0, 0, 1]]  # the last 3 tokens, after 5 cached ones


@pytest.mark.parametrize("position", [{"name": "learned", "per_document": True},
                                      {"name": "sinusoidal", "per_document": True},
                                      {"name": "rope", "per_document": True}])
def test_with_positions_per_document_a_packed_document_reads_as_alone_for_every_scheme(position) -> None:
    """Absolute positions (learned, sinusoidal) see a document inside a packed block at other positions than alone;
    counted from the document's start (position.per_document) with its documents masked, its outputs are exactly the
    document's own. Without per_document, not."""
    a, b = [5, 6, 7, 8, 9, E], [10, 11, 12, 13, 14, 15, 16, E]
    packed = torch.tensor([a + b + [17, 18]])
    model = _model(position=position)
    with torch.no_grad():
        torch.testing.assert_close(model(packed)[:, len(a):len(a) + len(b)], model(torch.tensor([b])), **TOL)
    if position["name"] != "rope":  # RoPE is relative: masked documents read alike either way
        absolute = _model(position={**position, "per_document": False})
        with torch.no_grad():
            assert not torch.allclose(absolute(packed)[:, len(a):len(a) + len(b)], absolute(torch.tensor([b])), **TOL)


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_the_kv_cache_counts_positions_per_document(position) -> None:
    idx = torch.tensor([[5, 6, E, 7, 8, 9, E, 10, 11, E, E, 12, 13, 14, 15, 16]])
    model = _model(position={"name": position, "per_document": True}, attention={"name": "mha"})  # no doc mask
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(2)
        steps = [model(idx[:, :4], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(4, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


def test_positions_per_document_without_an_end_of_document_token_are_refused_by_key() -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=r"position.per_document=true needs an end-of-document token .* data.eod"):
        check_config(compose(["position.per_document=true"]))
