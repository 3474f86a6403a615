"""residual=canon (Allen-Zhu, 2025): one canon layer against h_t + Σ_i w_i ⊙ h_{t-i} on a hand example; the block
reading its sublayers' inputs through them at A and C; init=zero the standard model; cached generation equal to the
full forward (prompts of several tokens, post-norm, a hybrid stack, GAU); the size estimate; the other options'
state-dict keys unchanged; refusals by key. Causality, a packed document read alone and training:
test_residual_options.py, over the options."""

from __future__ import annotations

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.attention.cache import KVCache
from lmlab.model.gpt import GPT, validate
from lmlab.model.residual import RESIDUALS
from lmlab.model.residual.canon import CanonLayers
from lmlab.model.resolve import n_params_estimate
from tests.unit.model.options import assert_refused

V, EOD = 40, 0
BASE = dict(vocab_size=V, n_layer=2, d_model=32, n_head=4, max_seq_len=32, position={"name": "rope"},
            norm={"name": "rms"})


def _model(canon: dict | None = None, **kw) -> GPT:
    torch.manual_seed(0)
    residual = {"canon": canon or {}} if canon is not None else {}
    return GPT(validate(GPTConfig(**{**BASE, "residual": residual, **kw}))).double().eval()


def _idx(T: int = 20, B: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (B, T), generator=torch.Generator().manual_seed(seed))  # no end-of-document token


def test_a_canon_layer_is_its_formula_on_a_hand_example() -> None:
    """d = 2 channels, k = 3: h'_t = h_t + w_0 h_t + w_1 h_{t-1} + w_2 h_{t-2}, the missing past read as zero."""
    layer = CanonLayers({1: "A"}, d_model=2, kernel=3, zero=False, doc_reset=False).double()
    w = torch.tensor([[0.5, -1.0, 2.0], [0.25, 0.0, -0.5]], dtype=torch.float64)  # w[c, i]: channel c, lag i
    with torch.no_grad():
        layer["A"].weight.copy_(w.flip(-1)[:, None, :])  # Conv1d's last tap reads the current token
    h = torch.tensor([[[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0]]], dtype=torch.float64)  # (1, T=4, 2)
    want = torch.tensor([[[1 + 0.5 * 1, 10 + 0.25 * 10],
                          [2 + 0.5 * 2 - 1.0 * 1, 20 + 0.25 * 20],
                          [3 + 0.5 * 3 - 1.0 * 2 + 2.0 * 1, 30 + 0.25 * 30 - 0.5 * 10],
                          [4 + 0.5 * 4 - 1.0 * 3 + 2.0 * 2, 40 + 0.25 * 40 - 0.5 * 20]]], dtype=torch.float64)
    torch.testing.assert_close(layer(1, h, None, None), want, rtol=0, atol=1e-12)
    assert torch.equal(layer(2, h, None, None), h)  # a sublayer without a canon layer reads its input as it is


def test_a_document_start_cuts_the_window() -> None:
    """Documents [0, 0, 1, 1, 1]: tokens 2.. read nothing of tokens 0, 1 (as if their document came alone)."""
    layer = CanonLayers({1: "A"}, d_model=3, kernel=4, zero=False, doc_reset=True).double()
    h = torch.randn(1, 5, 3, dtype=torch.float64)
    doc = torch.tensor([[0, 0, 1, 1, 1]])
    out = layer(1, h, None, doc)
    torch.testing.assert_close(out[:, :2], layer(1, h[:, :2], None, None), rtol=0, atol=1e-12)
    torch.testing.assert_close(out[:, 2:], layer(1, h[:, 2:], None, None), rtol=0, atol=1e-12)


def _trace(model: GPT, idx: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    ins, outs = [], []
    hooks = [b.register_forward_pre_hook(lambda m, a: ins.append(a[0])) for b in model.h]
    hooks += [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in model.h]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    return ins, outs


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_the_block_reads_attention_and_ffn_inputs_through_canon_a_and_c(placement: str) -> None:
    """pre: x ← x + Attn(A(N_1(x))), x ← x + FFN(C(N_2(x))); post: x ← N_1(x + Attn(A(x))), x ← N_2(x + FFN(C(x)))."""
    model = _model({}, placement={"name": placement})
    idx = _idx()
    ins, outs = _trace(model, idx)

    def conv(layer, h):  # the canon layer written out: h_t + Σ_i w_i ⊙ h_{t-i}
        w = layer.weight[:, 0].flip(-1)  # (d, k): w[:, i] multiplies h_{t-i}
        return h + sum(w[:, i] * torch.nn.functional.pad(h, (0, 0, i, 0))[:, :h.size(1)] for i in range(w.size(1)))

    with torch.no_grad():
        for i, block in enumerate(model.h):
            x = ins[i]
            for j, f, p in ((1, lambda h: block.attn(h, model.pos), "A"), (2, block.mlp, "C")):
                if placement == "pre":
                    x = x + f(conv(block.canon[p], block.norm(j)(x)))
                else:
                    x = block.norm(j)(x + f(conv(block.canon[p], x)))
            torch.testing.assert_close(outs[i], x, rtol=1e-10, atol=1e-10)


def test_zero_init_is_the_standard_model_and_still_learns_its_weights() -> None:
    canon, standard = _model({"init": "zero"}), _model()
    missing, unexpected = canon.load_state_dict(standard.state_dict(), strict=False)
    assert not unexpected and missing and all(".canon." in k for k in missing)
    assert all(torch.equal(p, torch.zeros_like(p)) for k, p in canon.named_parameters() if ".canon." in k)
    idx = _idx()
    with torch.no_grad():
        torch.testing.assert_close(canon(idx), standard(idx), rtol=0, atol=0)
    canon.train()(idx, targets=idx.roll(-1, 1)).backward()
    assert all(p.grad.abs().sum() > 0 for k, p in canon.named_parameters() if ".canon." in k)


def test_the_default_init_is_the_papers_conv1d_default() -> None:
    """torch's Conv1d init (Kaiming uniform, a = √5): w ~ U(−1/√k, 1/√k); lmlab's init pass leaves it."""
    model = _model({"kernel": 4}, n_layer=4, d_model=64, n_head=4)
    w = torch.cat([p.flatten() for k, p in model.named_parameters() if ".canon." in k])
    w = w.detach()
    assert 0.49 < w.abs().max() <= 0.5 and abs(float(w.mean())) < 0.03
    assert float(w.var()) == pytest.approx(0.5 ** 2 / 3, rel=0.1)  # the variance of U(−½, ½): 1/12


CACHED = {
    "pre": {},
    "kernel=2+C": {"canon": {"kernel": 2, "positions": ["C"]}},
    "kernel=6+post": {"canon": {"kernel": 6}, "placement": {"name": "post"}},
    "hybrid": {"mixer": {"name": "linear", "pattern": ["linear", "attention"]}},
    "gau": {"canon": {"positions": ["A"]}, "block": {"name": "gau", "s": 16}},
    "parallel+scaled": {"residual": {"parallel": {}, "scaled": {"branch_init": 0.5}, "canon": {}}},
    "doc_mask": {"eod_id": EOD, "attention": {"name": "mha", "doc_mask": True}},
}


@pytest.mark.parametrize("case", sorted(CACHED))
def test_cached_generation_gives_the_full_forward(case: str) -> None:
    """A prompt of 7, then 4 tokens at once, then one at a time: the cache's last k − 1 inputs per canon layer
    continue the convolution exactly. (Greedy generation over every residual option: test_generate.py.)"""
    kw = dict(CACHED[case])
    model = _model(kw.pop("canon", {}), **kw) if "residual" not in kw else _model(None, **kw)
    idx = _idx(T=24)
    if "eod_id" in kw:
        idx[:, [3, 9, 15]] = EOD  # documents start inside the prompt, the block of 4 and the single steps
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(len(model.h))
        steps = [model(idx[:, :7], cache=cache), model(idx[:, 7:11], cache=cache)]
        steps += [model(idx[:, t:t + 1], cache=cache) for t in range(11, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)
    k = model.cfg.residual["canon"]["kernel"]
    held = {key: s.shape for key, s in cache.layers[0].inputs.items()}
    assert held == {f"canon_{p}": (2, k - 1, 32) for p in model.cfg.residual["canon"]["positions"]}


def test_checkpointing_gives_the_same_gradients() -> None:
    grads = []
    for checkpointing in (False, True):
        model = _model({}, checkpointing=checkpointing, eod_id=EOD,
                       attention={"name": "mha", "doc_mask": True}).train()
        idx = _idx()
        idx[:, 6] = EOD
        model(idx, targets=idx.roll(-1, 1)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize("canon", [{}, {"kernel": 3, "positions": ["A"]}])
def test_the_size_estimate_counts_the_canon_weights(canon: dict) -> None:
    cfg = GPTConfig(**{**BASE, "residual": {"canon": canon}})
    with torch.device("meta"):
        built = GPT(cfg).num_params()
    plain = GPTConfig(**BASE)
    k, n = canon.get("kernel", 4), len(canon.get("positions", "AC"))
    assert n_params_estimate(cfg) - n_params_estimate(plain) == 2 * n * 32 * k
    assert n_params_estimate(cfg) <= built <= 1.01 * n_params_estimate(cfg)


@pytest.mark.parametrize("other", sorted(set(RESIDUALS) - {"canon", "hyper"}))
def test_the_other_options_keep_their_state_dict_keys(other: str) -> None:
    """Canon adds `h.<i>.canon.<A|C>.weight` and nothing else; without it, no block has an input transform."""
    params = {"value_embed": {"tables": 1}}.get(other, {})
    without = _model(None, residual={other: params})
    with_canon = _model(None, residual={other: params, "canon": {}})
    added = set(with_canon.state_dict()) - set(without.state_dict())
    assert set(without.state_dict()) <= set(with_canon.state_dict())
    assert added == {f"h.{i}.canon.{p}.weight" for i in range(2) for p in "AC"}
    assert all(b.input_transforms == () for b in without.h)
    assert all(b.input_transforms == ("canon",) for b in with_canon.h)


@pytest.mark.parametrize("overrides,message", [
    (["residual.canon.positions=[A,B]"], r"residual\.canon\.positions=\['A', 'B'\]: canon-B acts on q, k, v inside "
                                         r"attention"),
    (["residual.canon.positions=[D]"], r"canon-D acts on the FFN's gate and up projections"),
    (["residual.canon.positions=[A,E]"], r"residual\.canon\.positions=\['A', 'E'\] must be a list of one of"),
    (["residual.canon.positions=[]"], r"residual\.canon\.positions=\[\] must name A, C or both, each once"),
    (["residual.canon.positions=[C,C]"], r"must name A, C or both, each once"),
    (["residual.canon.kernel=0"], r"residual\.canon\.kernel=0 must be an integer >= 1"),
    (["residual.canon.init=ones"], r"residual\.canon\.init='ones' must be one of \['kaiming', 'zero'\]"),
    (["block=gau"], r"block='gau' has no sublayer for canon-C .* use residual\.canon\.positions=\[A\]"),
])
def test_bad_canon_input_is_named_before_training(overrides: list[str], message: str) -> None:
    assert_refused(["residual=canon", *overrides], message)


def test_the_yaml_composes_to_the_papers_defaults() -> None:
    from lmlab.run.checks import check_config

    cfg = compose(["residual=canon"])
    assert cfg.residual == {"canon": {"kernel": 4, "positions": ["A", "C"], "init": "kaiming"}}
    check_config(cfg)
    check_config(compose(["residual=[canon,scaled]", "block=gau", "residual.canon.positions=[A]"]))


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_the_training_forward_compiles_to_one_graph_with_document_cuts() -> None:
    """The document cut is a mask, not a branch on the data: packed training under torch.compile stays one graph."""
    model = GPT(validate(GPTConfig(**{**BASE, "residual": {"canon": {}}, "eod_id": EOD,
                                      "attention": {"name": "mha", "doc_mask": True}}))).train()
    idx = _idx(T=16)
    idx[:, 5] = EOD
    torch._dynamo.reset()
    ex = torch._dynamo.explain(model)(idx, idx)
    assert (ex.graph_count, ex.graph_break_count) == (1, 0), [str(b.reason) for b in ex.break_reasons]
