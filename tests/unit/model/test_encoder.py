"""The encoder objectives (lmlab.model.encoder): head=mlm's loss against a hand computation, BERT's 80/10/10 masking
within binomial bounds and keyed by sequence, bidirectional attention on every attention path (GAU included) against
masks and biases written out, the refusals by key, and head=classify's loss and accuracy by hand."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.attention.score import SCORES, attend, explicit_weights, scale_queries
from lmlab.model.encoder import IGNORE, MaskedLM
from lmlab.model.gpt import GPT, validate
from lmlab.model.head import fit_head
from lmlab.model.position import POSITIONS, alibi_slopes
from tests.unit.model.options import assert_refused, trunk

V = 41  # 40 tokenizer ids and [MASK] = 40


def _model(head: dict | None = None, **kw) -> GPT:
    base = dict(vocab_size=V, n_layer=2, d_model=32, n_head=4, max_seq_len=16, position={"name": "rope"},
                norm={"name": "rms"}, head=head or {"name": "mlm"})
    torch.manual_seed(0)
    return GPT(validate(GPTConfig(**{**base, **kw})))


def _tokens(B: int = 3, T: int = 16, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V - 1, (B, T), generator=torch.Generator().manual_seed(seed))


def _keys(n: int, first: int = 0) -> list[tuple[int, int, int]]:
    return [(1337, 0, first + r) for r in range(n)]


# --- head=mlm: the loss -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw", [{}, {"chunked_loss": True}, {"logit_softcap": 5.0}])
def test_the_mlm_loss_is_the_cross_entropy_of_the_chosen_positions_by_hand(kw: dict) -> None:
    model = _model(**kw).eval()
    x = _tokens()
    inputs, targets = model.head.prepare(x, x.roll(-1, 1), _keys(3))
    chosen = targets != IGNORE
    assert torch.equal(targets[chosen], x[chosen]) and (chosen.sum(1) == round(0.15 * 16)).all()
    loss = model(inputs, targets)
    with torch.no_grad():  # the logits of the corrupted text; -log p(original token) at the chosen positions only
        z = model(inputs).double()  # (B, T, V), softcapped when set
        logp = z - z.logsumexp(-1, keepdim=True)
        picked = logp.gather(-1, x[..., None]).squeeze(-1)  # (B, T)
        want = -(picked * chosen).sum() / chosen.sum()
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    everywhere = -picked.mean()  # not the loss over every position: the unchosen ones are left out
    assert abs(loss.item() - everywhere.item()) > 1e-4


def test_bert_masking_80_10_10_within_binomial_bounds() -> None:
    """Exactly round(p·T) positions a sequence, uniform over the positions; of the chosen, [MASK] / random / unchanged
    in 0.8 / 0.1 / 0.1 (a random token equal to the original counted as unchanged: 0.1·(1 + 1/(V−1)) expected), each
    within 5 binomial standard deviations; the unchosen positions as they were, with IGNORE targets."""
    vocab = 1001  # 1000 tokenizer ids: a random token seldom equals the original
    model = MaskedLM(GPTConfig(vocab_size=vocab), mask_prob=0.15)
    B, T = 400, 100
    x = torch.randint(0, vocab - 1, (B, T), generator=torch.Generator().manual_seed(0))
    inputs, targets = model.prepare(x, x, _keys(B))
    chosen = targets != IGNORE
    assert (chosen.sum(1) == 15).all()
    assert torch.equal(inputs[~chosen], x[~chosen])

    def within(count: torch.Tensor | int, n: int, p: float) -> bool:
        return abs(int(count) - n * p) <= 5 * math.sqrt(n * p * (1 - p))

    per_position = chosen.sum(0)  # each position chosen in ~15% of the sequences
    assert all(within(c, B, 0.15) for c in per_position.tolist())
    n = int(chosen.sum())
    masked = (inputs == vocab - 1) & chosen
    unchanged = (inputs == x) & chosen
    random = chosen & ~masked & ~unchanged
    assert within(masked.sum(), n, 0.8)
    assert within(random.sum(), n, 0.1 * (1 - 1 / (vocab - 1)))
    assert within(unchanged.sum(), n, 0.1 + 0.1 / (vocab - 1))
    assert int(inputs[random].max()) < vocab - 1  # random tokens are the tokenizer's, never [MASK]
    # and spread over them (a uniform draw): the 1000 ids in ~600 draws hit hundreds of them
    assert len(inputs[random].unique()) > 0.4 * int(random.sum())


def test_the_masks_are_a_function_of_each_sequences_key() -> None:
    head = _model().head
    x = _tokens(4)
    a = head.prepare(x, x, _keys(4))
    assert all(torch.equal(p, q) for p, q in zip(a, head.prepare(x, x, _keys(4))))  # the same keys: the same
    b = head.prepare(x[2:], x[2:], _keys(2, first=2))  # a sequence's draws do not depend on its batch
    assert torch.equal(b[0], a[0][2:]) and torch.equal(b[1], a[1][2:])
    c = head.prepare(x, x, _keys(4, first=4))
    assert not torch.equal(c[1], a[1])  # other sequences of the stream: other positions
    d = head.prepare(x, x, [(7, 0, r) for r in range(4)])
    assert not torch.equal(d[1], a[1])  # another seed: other positions


def test_padding_is_never_chosen_and_counts_no_position() -> None:
    """data.packing=padded: an input is padding where the target before it is IGNORE."""
    head = MaskedLM(GPTConfig(vocab_size=V), mask_prob=0.25)
    x = _tokens(2)
    y = x.roll(-1, 1).clone()
    y[0, 7:] = IGNORE  # row 0: 8 real inputs (positions 0 .. 7), the rest padding
    inputs, targets = head.prepare(x, y, _keys(2))
    chosen = targets != IGNORE
    assert int(chosen[0].sum()) == 2 and not chosen[0, 8:].any()  # round(0.25 · 8)
    assert int(chosen[1].sum()) == 4 and torch.equal(inputs[0, 8:], x[0, 8:])


# --- bidirectional attention ---------------------------------------------------------------------------------------

ENCODERS = {
    "mha+rope": {},
    "gqa+alibi": {"attention": {"name": "gqa"}, "n_kv_head": 2, "position": {"name": "alibi"}},
    "t5": {"position": {"name": "t5"}},
    "learned+relu2": {"position": {"name": "learned"}, "attention": {"name": "mha", "score": "relu2"}},
    "softmax_plus": {"attention": {"name": "mha", "score": "softmax_plus"}},
    "sinks+softcap+mem_kv": {"attention": {"name": "mha", "softcap": 2.0, "mem_kv": 2}},
    "sinks": {"attention": {"name": "mha", "sinks": True}},
    "mla": {"attention": {"name": "mla"}},
    "diff": {"attention": {"name": "diff"}},
    "talking_heads": {"attention": {"name": "talking_heads"}},
    "cosine": {"attention": {"name": "cosine"}},
    "logn_scaling": {"attention": {"name": "mqa", "logn_scaling": True}, "train_len": 8},
    "gau+softmax_plus": {"block": {"name": "gau", "s": 16}, "activation": {"name": "silu"}},
    "gau+relu2": {"block": {"name": "gau", "s": 16, "score": "relu2"}},
    "gau+softmax+alibi+post": {"block": {"name": "gau", "s": 16, "score": "softmax"}, "position": {"name": "alibi"},
                               "placement": {"name": "post"}},
}


@pytest.mark.parametrize("name", ENCODERS)
def test_a_later_token_changes_an_earlier_output_only_when_bidirectional(name: str) -> None:
    x = _tokens(2)
    later = x.clone()
    later[:, -1] = (later[:, -1] + 1) % (V - 1)
    for head, moves in (({"name": "next"}, False), ({"name": "mlm"}, True)):
        model = _model(head, **ENCODERS[name]).eval()
        with torch.no_grad():  # sharp attention: at init it is nearly uniform (relu²'s weights nearly 0)
            for n, p in model.named_parameters():
                if n.endswith(("attn.c_attn.weight", "attn.q_proj.weight", "attn.kv_b.weight", "q_gamma", "k_gamma")):
                    p.mul_(4)
            change = (model(x)[:, :-1] - model(later)[:, :-1]).abs().amax(-1)  # (B, T - 1): before the change
        if moves:  # softmax: every earlier position; relu²: those whose logit to the key is positive
            assert (change > 0).float().mean() > (0.2 if "relu2" in name else 0.99), (name, change)
        else:
            assert float(change.max()) == 0.0, (name, change)


def _qkv(B: int = 2, h: int = 4, T: int = 12, d: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, h, T, d, generator=g), torch.randn(B, h, T, d, generator=g),
            torch.randn(B, h, T, d, generator=g))


def _both_ways(name: str, **params):
    pos = POSITIONS[name](32, 8, 4, 12, 12, {"name": "none"}, **params)
    pos.causal = False
    return pos


@pytest.mark.parametrize("score", sorted(SCORES))
def test_bidirectional_attention_is_the_unmasked_formula_written_out(score: str) -> None:
    """softmax(q·k/√d) v over every key, softmax_plus with log_L(T) for every query (each reads all T keys), relu²/T:
    on the fused path (SDPA, no causal mask) and the explicit one."""
    q, k, v = _qkv()
    s, scale, T = SCORES[score](8), 1 / math.sqrt(8), q.size(-2)
    logits = (q @ k.transpose(-2, -1)) * scale
    if score == "softmax_plus":
        logits = logits * math.log(T) / math.log(8)
    want = (torch.relu(logits) ** 2 / T if score == "relu2" else logits.softmax(-1)) @ v
    pos = _both_ways("rope")  # its hooks add nothing to the logits: the masks and counts alone
    qs = scale_queries(q, s, 0, causal=False)
    torch.testing.assert_close(attend(qs, k, v, s, scale, pos), want)
    weights, _ = explicit_weights(qs, k, s, scale, pos)
    torch.testing.assert_close(weights @ v, want)


def test_bidirectional_alibi_and_t5_are_their_two_sided_biases() -> None:
    """ALiBi: −slope_h·|i − j|; T5: the encoder's buckets (transformers' `_relative_position_bucket`,
    bidirectional=True), written out here."""
    T = 12
    alibi = _both_ways("alibi").attn_bias(T, torch.device("cpu"), torch.float32)
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    torch.testing.assert_close(alibi, -alibi_slopes(4)[:, None, None] * (i - j).abs().float())

    t5 = _both_ways("t5", num_buckets=8, max_distance=10)
    rel = j - i  # the key's position minus the query's

    def bucket(r: int) -> int:
        half, exact = 4, 2
        out = half if r > 0 else 0
        n = abs(r)
        if n < exact:
            return out + n
        return out + min(half - 1, exact + int(math.log(n / exact) / math.log(10 / exact) * (half - exact)))

    want = t5.table.weight[torch.tensor([[bucket(int(r)) for r in row] for row in rel])].permute(2, 0, 1)
    torch.testing.assert_close(t5.attn_bias(T, torch.device("cpu"), torch.float32), want)
    assert torch.isfinite(t5.attn_bias(T, torch.device("cpu"), torch.float32)).all()


def test_the_flex_path_reads_every_key_when_bidirectional(monkeypatch) -> None:
    from lmlab.model.attention import flex

    monkeypatch.setattr(flex, "FLEX_DEVICES", {"cuda", "cpu"})
    q, k, v = _qkv()
    with torch.no_grad():
        got = flex.flex_attend(q, k, v, scale=0.3, offset=0, softcap=2.0, causal=False)
    want = (2.0 * torch.tanh((q @ k.transpose(-2, -1)) * 0.3 / 2.0)).softmax(-1) @ v
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_bidirectional_model_is_the_same_through_every_path(monkeypatch) -> None:
    """The fused path (SDPA), the explicit one (a sink of -inf logit is no sink) and FlexAttention (softcap) agree."""
    from lmlab.model.attention import flex

    x = _tokens(2)
    plain = _model(attention={"name": "mha", "softcap": 50.0}).eval()
    with torch.no_grad():
        explicit = plain(x)
        monkeypatch.setattr(flex, "FLEX_DEVICES", {"cuda", "cpu"})
        through_flex = plain(x)
    torch.testing.assert_close(through_flex, explicit, rtol=1e-4, atol=1e-4)
    sdpa = _model(attention={"name": "mha"}).eval()
    sinks = _model(attention={"name": "mha", "sinks": True}).eval()
    sinks.load_state_dict({**sdpa.state_dict(), **{k: torch.full_like(v, -1e4) for k, v in sinks.state_dict().items()
                                                     if k.endswith("attn.sink")}})
    with torch.no_grad():
        torch.testing.assert_close(sinks(x), sdpa(x), rtol=1e-5, atol=1e-5)


def test_documents_bound_a_bidirectional_query_to_its_own_document() -> None:
    """attention.doc_mask both ways: each token reads its whole document and nothing of the next one."""
    model = _model(attention={"name": "mha", "doc_mask": True, "score": "softmax_plus"}, eod_id=0).eval()
    x = _tokens(1)
    x[0, 5] = 0  # document 0: positions 0 .. 5; document 1: 6 ..
    later = x.clone()
    later[0, 12] = (later[0, 12] + 1) % (V - 1) or 1
    with torch.no_grad():
        a, b = model(x), model(later)
    assert torch.equal(a[0, :6], b[0, :6])  # the first document never reads the second
    assert (a[0, 6:12] - b[0, 6:12]).abs().amax(-1).min() > 1e-6  # the second reads its later tokens


# --- refusals by key ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("overrides", "message"), [
    (["head=mlm", "position=fire"], "position=fire"),
    (["head=mlm", "position=cope"], "position=cope"),
    (["head=mlm", "position=xpos"], "position=xpos"),
    (["head=mlm", "position=none"], "position=none"),
    (["head=mlm", "position=rope", "attention.window=8"], "attention.window"),
    (["head=mlm", "position=rope", "attention.window=8", "attention.pattern=[local,global]"], "attention.window"),
    (["head=mlm", "position=rope", "attention.forget_gate=true"], "attention.forget_gate"),
    (["head=mlm", "position=rope", "mixer=gdn"], "mixer=gdn"),
    (["head=mlm", "position=rope", "mixer=mamba2", "mixer.pattern=[mamba2,attention]"], "mixer=mamba2"),
    (["head=mlm", "position=rope", "head.mask_frac=0.95"], "head.mask_frac"),
    (["head=mlm", "position=rope", "downstream.tasks=[shakespeare_mc]"], "downstream.tasks"),
    (["head=classify", "position=rope", "head.labels=[a]"], "head.labels"),
])
def test_what_cannot_read_both_ways_is_refused_by_key(overrides: list[str], message: str) -> None:
    assert_refused(overrides, message)


def test_the_kv_cache_and_generation_refuse_a_bidirectional_model() -> None:
    from lmlab.analysis.generate import generate

    model = _model().eval()
    x = _tokens(1)
    with pytest.raises(ValueError, match="head=mlm is bidirectional.*KV cache"):
        model(x, cache=KVCache(len(model.h)))
    for use_cache in (True, False):
        with pytest.raises(ValueError, match="head=mlm does not predict the next token"):
            generate(model, x, 3, use_cache=use_cache)
    with pytest.raises(ValueError, match="head=mlm does not predict the next token"):
        model.next_token_model()


def test_export_refuses_the_encoder_heads_by_key() -> None:
    from lmlab.interop.hf_config import family
    from lmlab.interop.refusal import NotRepresentable

    for head in ({"name": "mlm"}, {"name": "classify", "labels": ["a", "b"]}):
        with pytest.raises(NotRepresentable, match=f"head='{head['name']}'"):
            family(_model(head).cfg)
    assert family(_model({"name": "next"}, ffn={"name": "swiglu"}).cfg) == "llama"


def test_a_head_is_fitted_to_its_data_or_refused_by_key() -> None:
    spec, reserved = fit_head({"name": "classify", "labels": None, "pool": "mean"}, ["a", "b"], "labelled")
    assert spec["labels"] == ["a", "b"] and reserved == 1
    assert fit_head({"name": "mlm"}, None, "shakespeare") == ({"name": "mlm"}, 1)
    assert fit_head({"name": "next"}, None, "shakespeare")[1] == 0
    with pytest.raises(ValueError, match="train a classifier on it with head=classify, not head=mlm"):
        fit_head({"name": "mlm"}, ["a", "b"], "labelled")
    with pytest.raises(ValueError, match="needs a labelled set, data=labelled"):
        fit_head({"name": "classify"}, None, "shakespeare")
    with pytest.raises(ValueError, match="leave head.labels=null"):
        fit_head({"name": "classify", "labels": ["x", "y"]}, ["a", "b"], "labelled")


# --- head=classify ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pool", ["mean", "first"])
def test_the_classifiers_loss_and_accuracy_by_hand(pool: str) -> None:
    model = _model({"name": "classify", "labels": ["a", "b", "c"], "pool": pool}).train()
    x = _tokens(4)
    x[0, 9:] = V - 1  # padding ([MASK]) after 9 tokens; row 1 after 3
    x[1, 3:] = V - 1
    labels = torch.tensor([0, 2, 1, 2])
    objective, ce, _ = model(x, labels, parts=True)
    with torch.no_grad():
        h = model.ln_f(trunk(model, x)).double()  # (B, T, d)
        real = (x != V - 1).double()[..., None]
        pooled = h[:, 0] if pool == "first" else (h * real).sum(1) / real.sum(1)
        logits = pooled @ model.head.out.weight.double().T + model.head.out.bias.double()  # (B, 3)
        want = (logits.logsumexp(-1) - logits.gather(-1, labels[:, None]).squeeze(-1)).mean()
        accuracy = (logits.argmax(-1) == labels).double().mean()
    assert ce.item() == pytest.approx(want.item(), rel=1e-5)
    assert objective.item() == pytest.approx(want.item(), rel=1e-5)  # the accuracy is a figure, weight 0
    assert model.figures("train")["accuracy"].item() == pytest.approx(accuracy.item())
    torch.testing.assert_close(model.eval()(x).double(), logits, rtol=1e-5, atol=1e-5)  # forward(idx): the logits
    if pool == "mean":  # the padding is out of the mean, not out of attention (which reads it, both ways)
        assert model.head.pooled(h, x).shape == (4, 32)


def test_a_classifier_fine_tuned_from_an_mlm_run_takes_itstrunk() -> None:
    from lmlab.run.plan import load_init_from

    mlm = _model()
    cls = _model({"name": "classify", "labels": ["a", "b"]})
    with torch.no_grad():
        for p in mlm.parameters():
            p.add_(1.0)  # unlike any init
    fresh = {k: v.clone() for k, v in cls.state_dict().items() if k.startswith("head.")}
    load_init_from(cls, cls.cfg.to_dict(), {"model": mlm.cfg.to_dict(), "weights": mlm.state_dict(), "path": "run"})
    state = cls.state_dict()
    assert all(torch.equal(state[k], v) for k, v in mlm.state_dict().items())  # the trunk, the embedding, [MASK]'s row
    assert all(torch.equal(state[k], v) for k, v in fresh.items())  # its own layer as it was built
    nxt = _model({"name": "next"}, vocab_size=V - 1)  # a decoder's vocabulary has no [MASK]
    with pytest.raises(ValueError, match="head=classify reads 1 id.*head=next 0"):
        load_init_from(cls, cls.cfg.to_dict(), {"model": nxt.cfg.to_dict(), "weights": nxt.state_dict(),
                                                "path": "run"})


def test_the_encoder_heads_size_estimate_is_exact() -> None:
    from lmlab.model.resolve import n_params_estimate

    for head in ({"name": "mlm"}, {"name": "classify", "labels": ["a", "b", "c"]}):
        model = _model(head)
        gains = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 1 and not n.startswith("head."))
        assert n_params_estimate(model.cfg) == model.num_params() - gains, head


def test_validation_masks_the_same_windows_alike_whatever_the_batch_size() -> None:
    """LitGPT keys a validation window by its index in the validation (reset at each one), not by its batch."""
    from lmlab.run.lit import LitGPT

    lit = LitGPT(model=_model().cfg.to_dict(), optim={"name": "adamw", "lr": 1e-3}, schedule={"name": "constant"},
                 max_steps=1, seed=5)
    x = _tokens(4)
    lit.on_validation_epoch_start()
    halves = [lit.prepare((x[:2], x[:2]), "val"), lit.prepare((x[2:], x[2:]), "val")]
    lit.on_validation_epoch_start()
    whole = lit.prepare((x, x), "val")
    for i in range(2):
        assert torch.equal(torch.cat([h[i] for h in halves]), whole[i])
    assert (whole[1] != IGNORE).any()
