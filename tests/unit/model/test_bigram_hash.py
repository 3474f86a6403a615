"""residual=bigram_hash (the GPT-2 speedrun's records 62 and 83): the hash on a hand example and against the record's
int32 form; each layer's input plus λ_l·s_t ⊙ E[h_t] (read back from the blocks, sign trick and a narrower table
included); the sign table; cached generation equal to the full forward; the optimizer roles; the size
estimate; refusals by key. And the three speedrun options together: one compiled graph, the same gradients under
checkpointing. Causality, a packed document read alone and training: test_residual_options.py, over the options."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lmlab import build_model, compose
from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.gpt import GPT, validate
from lmlab.model.residual.bigram_hash import bigram_hash
from lmlab.model.resolve import n_params_estimate
from lmlab.optim import OPTIMIZERS, param_groups
from tests.unit.model.options import assert_refused

V, EOD = 40, 0
BASE = dict(vocab_size=V, n_layer=3, d_model=32, n_head=4, max_seq_len=32, position={"name": "rope"},
            norm={"name": "rms"})


def _model(bigram: dict | None = None, **kw) -> GPT:
    torch.manual_seed(0)
    residual = kw.pop("residual", {"bigram_hash": {"init": 0.5, **(bigram or {})}})
    return GPT(validate(GPTConfig(**{**BASE, "residual": residual, **kw}))).double().eval()


def _idx(T: int = 20, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))  # no end-of-document token


def test_the_hash_on_a_hand_example() -> None:
    """S = 11 rows: h_t = ((36313·x_t) XOR (27191·x_{t−1})) mod 10; the first token, and one without a previous token
    in its document, the reserved row 10."""
    idx, prev = torch.tensor([[3, 7, 7, 1]]), torch.tensor([[0, 3, 7, 7]])
    has = torch.tensor([[False, True, True, False]])
    assert (36313 * 7, 27191 * 3, 27191 * 7) == (254191, 81573, 190337)
    assert (254191 ^ 81573, 254191 ^ 190337) == (187978, 67438)  # the products XORed
    assert bigram_hash(idx, prev, has, 11).tolist() == [[10, 187978 % 10, 67438 % 10, 10]] == [[10, 8, 8, 10]]


def test_the_hash_is_the_records_int32_one_for_gpt2s_vocabulary() -> None:
    """The record computes in int32 over a flat batch; lmlab's int64 gives the same rows for 50,304 tokens (up to
    59,138: 36313·59137 < 2³¹)."""
    S = 5 * 50304
    x = torch.randint(0, 50304, (4096,), generator=torch.Generator().manual_seed(0))
    x[:3] = torch.tensor([50303, 50256, 50303])  # the largest products
    record = x.to(torch.int32).clone()
    record[0] = S - 1
    record[1:] = torch.bitwise_xor(36313 * record[1:], 27191 * x[:-1].to(torch.int32)) % (S - 1)
    has = torch.arange(x.numel()) > 0
    ours = bigram_hash(x[None], torch.cat((x[:1], x[:-1]))[None], has[None], S)[0]
    assert torch.equal(ours, record.long())


def _rows(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """b_t = s_t ⊙ E[h_t], padded to d_model, written out token by token in Python."""
    option = model.residual.options["bigram_hash"]
    S, dim = option.table.weight.shape
    out = torch.zeros(*idx.shape, model.cfg.d_model, dtype=torch.float64)
    for b, seq in enumerate(idx.tolist()):
        for t, x in enumerate(seq):
            h = S - 1 if t == 0 else ((36313 * x) ^ (27191 * seq[t - 1])) % (S - 1)
            sign = 1 if option.signs is None else option.signs[0 if t == 0 else (seq[t - 1] ^ x) % len(option.signs)]
            out[b, t, :dim] = option.table.weight[h] * sign
    return out


@pytest.mark.parametrize("bigram", [{}, {"size": 17, "dim": 12, "signs": 8, "init": -0.3}])
def test_every_layer_reads_its_input_plus_lambda_times_the_bigram_row(bigram: dict) -> None:
    """Layer 0 reads e + λ_0·b, layer l ≥ 1 its predecessor's output + λ_l·b (record 62's injection; with `signs`,
    record 83's sign trick, on the first `dim` channels)."""
    model = _model(bigram)
    with torch.no_grad():
        model.residual.options["bigram_hash"].lambdas.copy_(torch.tensor([0.5, -0.25, 2.0]))
    idx = _idx()
    ins, outs = [], []
    hooks = [b.register_forward_pre_hook(lambda m, a: ins.append(a[0])) for b in model.h]
    hooks += [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in model.h]
    with torch.no_grad():
        model(idx)
        b = _rows(model, idx)
        e = model.wte(idx)
    for h in hooks:
        h.remove()
    torch.testing.assert_close(ins[0], e + 0.5 * b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ins[1], outs[0] - 0.25 * b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ins[2], outs[1] + 2.0 * b, rtol=1e-12, atol=1e-12)
    assert model.residual.options["bigram_hash"].table.weight.shape == (bigram.get("size", 5 * V),
                                                                        bigram.get("dim", 32))


def test_the_sign_table_is_fixed_random_signs() -> None:
    """±1 only, about half each, the same at every build (so it is not saved), and a row per (x_{t−1} XOR x_t)."""
    a = _model({"signs": 64, "dim": 16}).residual.options["bigram_hash"]
    b = _model({"signs": 64, "dim": 16}, n_layer=2).residual.options["bigram_hash"]
    assert a.signs.shape == (64, 16) and set(a.signs.unique().tolist()) == {-1, 1}
    assert torch.equal(a.signs, b.signs) and abs(float(a.signs.double().mean())) < 0.1
    assert not any("signs" in k for k in _model({"signs": 64}).state_dict())


SPEEDRUN = {"scaled": {"stream": True}, "x0": {"init": 0.3}, "smear": {"init": 0.5}, "unet": {},
            "value_embed": {"tables": 1}, "bigram_hash": {"signs": 16, "dim": 8}, "backout": {}}
CACHED = {
    "plain": {},
    "signs+dim": {"residual": {"bigram_hash": {"signs": 16, "dim": 8, "init": 0.5}}},
    "doc_mask": {"eod_id": EOD, "attention": {"name": "mha", "doc_mask": True}},
    "the speedrun's stack, doc_mask": {"residual": SPEEDRUN, "eod_id": EOD, "embed_norm": True,
                                       "attention": {"name": "mha", "doc_mask": True}},
}


@pytest.mark.parametrize("case", sorted(CACHED))
def test_cached_generation_gives_the_full_forward(case: str) -> None:
    """A prompt of 7, then 4 tokens at once, then one at a time: the first token of each forward hashes with the
    last token of the one before, kept in the cache. (Greedy generation over every residual option:
    test_generate.py.)"""
    model = _model(**CACHED[case])
    idx = _idx(T=24)
    if "eod_id" in CACHED[case]:
        idx[:, [3, 6, 10, 15]] = EOD  # documents start inside the prompt and at the first token of the block of 4
        # and of the single steps (positions 4, 7, 11, 16)
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(len(model.h))
        steps = [model(idx[:, :7], cache=cache), model(idx[:, 7:11], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(11, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    assert torch.equal(cache.layers[0].inputs["bigram_hash"], idx[:, -1:])


def test_its_table_is_an_embedding_never_muons() -> None:
    """The table is an nn.Embedding (the no-decay group, AdamW under optim=muon), drawn by the model's init as every
    table; λ (L,) a vector: the same group."""
    model = build_model(compose(["residual=bigram_hash", "optim=muon", "model.vocab_size=50"]))
    option = model.residual.options["bigram_hash"]
    assert isinstance(option.table, nn.Embedding) and option.table.weight.shape == (250, model.cfg.d_model)
    assert float(option.table.weight.detach().std()) == pytest.approx(0.02, rel=0.1)  # init=gpt2: N(0, 0.02)
    mine = {id(option.table.weight), id(option.lambdas)}
    roles = {id(p): g["role"] for g in param_groups(model, 0.1, by_role=True) for p in g["params"]}
    assert {roles[i] for i in mine} == {"rest"}
    opt = OPTIMIZERS["muon"](param_groups(model, 0.1, by_role=True))
    assert {g["kind"] for g in opt.param_groups for p in g["params"] if id(p) in mine} == {"adamw"}
    assert all(g["weight_decay"] == 0.0 for g in param_groups(model, 0.1) if id(option.table.weight) in
               {id(p) for p in g["params"]})


@pytest.mark.parametrize("bigram", [{}, {"size": 1000, "dim": 8}])
def test_the_size_estimate_counts_the_table(bigram: dict) -> None:
    cfg = GPTConfig(**{**BASE, "residual": {"bigram_hash": bigram}})
    with torch.device("meta"):
        built = GPT(cfg).num_params()
    added = n_params_estimate(cfg) - n_params_estimate(GPTConfig(**BASE))
    assert added == bigram.get("size", 5 * V) * bigram.get("dim", 32) + 3
    assert n_params_estimate(cfg) <= built <= 1.01 * n_params_estimate(cfg)


@pytest.mark.parametrize("overrides,message", [
    (["residual.bigram_hash.size=0"], r"residual\.bigram_hash\.size=0 must be an integer >= 2 or null"),
    (["residual.bigram_hash.size=1"], r"residual\.bigram_hash\.size=1 must be an integer >= 2 or null"),
    (["residual.bigram_hash.dim=0"], r"residual\.bigram_hash\.dim=0 must be an integer >= 1 or null"),
    (["residual.bigram_hash.dim=65", "model.d_model=64"],
     r"residual\.bigram_hash\.dim=65 is wider than model\.d_model=64: use 1 \.\. 64, or null"),
    (["residual.bigram_hash.signs=-1"], r"residual\.bigram_hash\.signs=-1 must be an integer >= 0"),
])
def test_bad_bigram_input_is_named_before_training(overrides: list[str], message: str) -> None:
    assert_refused(["residual=bigram_hash", *overrides], message)


def test_the_yaml_composes_to_record_62s_defaults() -> None:
    from lmlab.run.checks import check_config

    cfg = compose(["residual=[x0,bigram_hash]"])
    assert cfg.residual["bigram_hash"] == {"size": None, "dim": None, "signs": 0, "init": 0.1}
    check_config(cfg)


def test_the_three_together_keep_their_gradients_under_checkpointing() -> None:
    grads = []
    for checkpointing in (False, True):
        model = _model(residual=SPEEDRUN, checkpointing=checkpointing, eod_id=EOD,
                       attention={"name": "mha", "doc_mask": True}).train()
        idx = _idx()
        idx[:, 6] = EOD
        model(idx, targets=idx.roll(-1, 1)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_the_training_forward_compiles_to_one_graph_with_document_cuts() -> None:
    """smear, bigram_hash and backout with the speedrun's other options, packed documents cut: one graph."""
    model = GPT(validate(GPTConfig(**{**BASE, "residual": SPEEDRUN, "eod_id": EOD,
                                      "attention": {"name": "mha", "doc_mask": True}}))).train()
    idx = _idx(T=16)
    idx[:, 5] = EOD
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(idx, idx)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(b.reason) for b in ex.break_reasons]
