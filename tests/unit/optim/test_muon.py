"""optim=muon: which tensors Muon takes (by rule, on every block kind), one step against torch.optim.Muon and
torch.optim.AdamW, the Newton–Schulz iteration by hand, the learning-rate scale conventions, the momentum warm-up,
and the one-object state_dict a checkpoint and a resume use; an MoE's stacked expert matrices orthogonalised one
expert at a time (a batched Newton–Schulz) against a per-expert loop of torch's Muon."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lmlab.config import GPTConfig
from lmlab.model.block import BLOCKS
from lmlab.model.gpt import GPT
from lmlab.optim import OPTIMIZERS, param_groups, validate_optim
from lmlab.optim.muon import NS_COEFFICIENTS, MuonAdamW, newton_schulz

TINY = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16)


MOE = {"name": "moe", "expert": "swiglu", "n_experts": 4, "top_k": 2, "hidden": 24}


def _model(**kw) -> GPT:
    return GPT(GPTConfig(**{**TINY, **kw}))


def _muon(model: nn.Module, **kw) -> MuonAdamW:
    return OPTIMIZERS["muon"](param_groups(model, 0.1, by_role=True), **kw)


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("block", sorted(BLOCKS))
def test_muon_takes_every_hidden_matrix_and_adamw_the_rest(block: str, tie: bool) -> None:
    """The rule: every 2-D weight of a Linear inside the blocks goes to Muon; embeddings, the LM head (tied or not),
    norm gains, biases and position tables to AdamW. Each parameter exactly once."""
    extras = {"qk_norm": True, "gate": "headwise"} if block == "transformer" else {}  # the attention sublayer's
    model = _model(block={"name": block}, bias=True, tie_embeddings=tie, position={"name": "learned"},
                   attention={"name": "mha", **extras})
    opt = _muon(model)
    kinds = {id(p): g["kind"] for g in opt.param_groups for p in g["params"]}
    hidden = {id(m.weight) for blk in model.h for m in blk.modules() if isinstance(m, nn.Linear)}
    assert hidden and {i for i, k in kinds.items() if k == "muon"} == hidden
    everything = {id(p) for p in model.parameters()}
    assert set(kinds) == everything and sum(len(g["params"]) for g in opt.param_groups) == len(everything)
    for name, p in model.named_parameters():
        if name.startswith(("wte", "lm_head", "pos", "ln_f")) or p.dim() < 2:
            assert kinds[id(p)] == "adamw", name
    muon_group = next(g for g in opt.param_groups if g["kind"] == "muon")
    assert muon_group["lr"] == 3e-3 and muon_group["adjust_lr_fn"] == "match_rms_adamw"
    assert {g["lr"] for g in opt.param_groups if g["kind"] == "adamw"} == {3e-3}


@pytest.mark.parametrize("overrides", [["attention=talking_heads"], ["residual=hyper"], ["residual=scaled"],
                                       ["mixer=gdn"], ["mixer=mamba2"], ["residual=canon"]])
def test_weights_of_more_than_one_dimension_that_are_no_linears_go_to_adamw(overrides: list[str]) -> None:
    """Talking heads' (nh, nh) mixes, hyper-connections' and scaled residuals' coefficients ((2, 1): Muon made the
    pair a unit vector each step), the depthwise convolutions of recurrent mixers and canon layers ((d, 1, k):
    torch's Muon refused them, so optim=muon crashed on mixer=gdn) are the `other` role: AdamW, decayed, at the base
    lr under µP too; every Linear inside the blocks stays Muon's."""
    from lmlab import build_model, compose
    from lmlab.model.param import PARAMS

    model = build_model(compose([*overrides, "optim=muon", "model.vocab_size=50"]))
    other = {id(p) for m in model.modules() if not isinstance(m, nn.Linear | nn.Embedding)
             for p in m.parameters(recurse=False) if p.dim() >= 2}
    assert other, "the option has such a weight"
    groups = param_groups(model, 0.1, by_role=True)
    assert {id(p) for g in groups if g["role"] == "other" for p in g["params"]} == other
    assert all(g["weight_decay"] == 0.1 for g in groups if g["role"] == "other")
    opt = _muon(model)
    kinds = {id(p): g["kind"] for g in opt.param_groups for p in g["params"]}
    assert {kinds[i] for i in other} == {"adamw"}
    hidden = {id(m.weight) for blk in model.h for m in blk.modules() if isinstance(m, nn.Linear)}
    assert {i for i, k in kinds.items() if k == "muon"} == hidden
    loss = model(torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16)))
    loss.backward()
    opt.step()  # torch's Muon raised on a (d, 1, k) weight
    mup = PARAMS["mup"](model.cfg, base_width=16)  # width_mult 8 at d_model 128
    assert mup.lr_mult("hidden") == 1 / 8 and mup.lr_mult("other") == 1.0


def test_newton_schulz_by_hand_and_torchs() -> None:
    """Five quintic steps X ← aX + (bA + cA²)X, A = XXᵀ, from X = G/‖G‖_F (a tall G transposed), written out in
    float64 (lmlab's runs in bf16, as torch's: within bf16's rounding); torch's own iteration gives the same bits.
    Its singular values land in about [0.5, 1.5] (the iteration's design: not exactly 1, faster)."""
    torch.manual_seed(0)
    a, b, c = NS_COEFFICIENTS
    for shape in ((8, 5), (5, 8)):
        G = torch.randn(*shape)
        X = G.double()
        if shape[0] > shape[1]:
            X = X.T
        X = X / X.norm()
        for _ in range(5):
            A = X @ X.T
            B = b * A + c * (A @ A)
            X = a * X + B @ X
        X = X.T if shape[0] > shape[1] else X
        torch.testing.assert_close(newton_schulz(G).double(), X, rtol=0, atol=0.05)
        assert torch.equal(newton_schulz(G), torch.optim._muon._zeropower_via_newtonschulz(G, NS_COEFFICIENTS, 5, 1e-7))
        s = torch.linalg.svdvals(X.float())
        assert s.min() > 0.5 and s.max() < 1.5, s


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_one_step_equals_torchs_muon_and_adamw(adjust: str) -> None:
    """One hybrid step = torch.optim.Muon on the hidden matrices (decay lr·wd, then −lr·s·NS(U)) and torch's AdamW
    on the rest, each with its own lr; and by hand: U = (1 − μ)g + μ·(1 − μ)g for the first nesterov step."""
    torch.manual_seed(0)
    model = _model(tie_embeddings=False)
    ref = copy.deepcopy(model)
    for p, q in zip(model.parameters(), ref.parameters()):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
    opt = _muon(model, lr=0.02, adam_lr=0.001, adjust_lr_fn=adjust)
    opt.step()
    groups = param_groups(ref, 0.1, by_role=True)
    hidden = groups[0]["params"]
    w0 = [p.detach().clone() for p in hidden]
    torch.optim.Muon([{"params": hidden, "weight_decay": 0.1}], lr=0.02, adjust_lr_fn=adjust).step()
    # the same AdamW kernel as lmlab's (fused on CPU, the auto default): torch's default for-loop kernel rounds
    # differently (3.7e-9 apart on AVX2), so exact equality holds only kernel against kernel
    assert all(g.get("fused") for g in opt.param_groups if g["kind"] == "adamw")
    torch.optim.AdamW([{k: v for k, v in g.items() if k != "role"} for g in groups[1:]], lr=0.001,
                      betas=(0.9, 0.95), eps=1e-8, fused=True).step()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    mu, lr = 0.95, 0.02
    for p, p0 in zip(hidden, w0):
        m, n = p.shape
        scale = 0.2 * max(m, n) ** 0.5 if adjust == "match_rms_adamw" else max(1, m / n) ** 0.5
        B = torch.zeros_like(p.grad).lerp_(p.grad, 1 - mu)  # B = (1 − μ)g, then U = g + μ(B − g), as torch rounds it
        U = p.grad.lerp(B, mu)
        torch.testing.assert_close(U, (1 - mu) * p.grad + mu * (1 - mu) * p.grad)
        expected = p0 * (1 - lr * 0.1) - lr * scale * newton_schulz(U).float()
        torch.testing.assert_close(p.detach(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["muon", "muon_experts"])
def test_momentum_warmup_rises_linearly_and_is_in_the_state_dict(kind: str) -> None:
    model = _model(ffn=MOE)
    opt = _muon(model, momentum=0.95, momentum_start=0.85, momentum_warmup_steps=4)
    seen = []
    for _ in range(6):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        seen.append(next(g for g in opt.param_groups if g["kind"] == kind)["momentum"])
    assert seen == pytest.approx([0.85, 0.875, 0.9, 0.925, 0.95, 0.95])
    assert next(g for g in opt.state_dict()["param_groups"] if g["kind"] == kind)["muon_step"] == 6


@pytest.mark.parametrize("ffn", [None, MOE], ids=["dense", "moe"])
def test_state_dict_round_trip_continues_exactly(ffn: dict | None) -> None:
    """A second optimizer loaded from the first's state_dict (what a resume does) takes the same next steps, Muon's
    momentum buffers (the experts' too) and AdamW's moments included; the state is one entry per parameter, torch's
    layout."""
    torch.manual_seed(0)
    model = _model(tie_embeddings=False, **({"ffn": ffn} if ffn else {}))
    opt = _muon(model, momentum_warmup_steps=3)
    grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(4)]

    def step(o, m, gs):
        for p, g in zip(m.parameters(), gs):
            p.grad = g.clone()
        o.step()

    for gs in grads[:2]:
        step(opt, model, gs)
    twin = copy.deepcopy(model)
    saved = copy.deepcopy(opt.state_dict())
    assert len(saved["state"]) == len(list(model.parameters()))
    assert {k for s in saved["state"].values() for k in s} == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    opt2 = _muon(twin, momentum_warmup_steps=3)
    opt2.load_state_dict(saved)
    for gs in grads[2:]:
        step(opt, model, gs)
        step(opt2, twin, gs)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_batched_newton_schulz_equals_a_per_expert_loop() -> None:
    """(E, m, n) stacks, wide and tall: each matrix as torch's 2-D iteration computes it, bit for bit."""
    torch.manual_seed(0)
    for shape in ((4, 24, 32), (3, 32, 12)):
        G = torch.randn(*shape)
        batched = newton_schulz(G)
        assert batched.shape == G.shape
        for e in range(shape[0]):
            assert torch.equal(batched[e], torch.optim._muon._zeropower_via_newtonschulz(G[e], NS_COEFFICIENTS, 5,
                                                                                        1e-7))


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_expert_matrices_are_orthogonalised_one_expert_at_a_time(adjust: str) -> None:
    """An MoE's c_fc (E·2h, d) and c_proj (E·d, h) hold E matrices each: two steps of Muon on them equal torch's Muon
    run on each expert's matrix alone (its own lr scale s(m, n) and momentum), not on the stack as one matrix."""
    torch.manual_seed(0)
    model = _model(ffn=MOE, tie_embeddings=False)
    opt = _muon(model, lr=0.02, adjust_lr_fn=adjust)
    stacks = [m for m in model.modules() if isinstance(m, nn.Linear) and getattr(m, "n_experts", 1) > 1]
    assert len(stacks) == 4 and {g["kind"] for g in opt.param_groups} == {"muon", "muon_experts", "adamw"}
    group = next(g for g in opt.param_groups if g["kind"] == "muon_experts")
    assert group["experts"] == 4 and {id(p) for p in group["params"]} == {id(m.weight) for m in stacks}
    E = 4
    refs = {id(m.weight): [nn.Parameter(w.clone()) for w in m.weight.detach().view(E, -1, m.in_features)]
            for m in stacks}
    ref_opts = {k: torch.optim.Muon([{"params": ps, "weight_decay": 0.1}], lr=0.02, adjust_lr_fn=adjust)
                for k, ps in refs.items()}
    whole = {id(m.weight): nn.Parameter(m.weight.detach().clone()) for m in stacks}  # the stack as one matrix
    whole_opt = torch.optim.Muon([{"params": list(whole.values()), "weight_decay": 0.1}], lr=0.02,
                                 adjust_lr_fn=adjust)
    for _ in range(2):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        for m in stacks:
            for ref, g in zip(refs[id(m.weight)], m.weight.grad.view(E, -1, m.in_features)):
                ref.grad = g.clone()
            whole[id(m.weight)].grad = m.weight.grad.clone()
        opt.step()
        for o in (*ref_opts.values(), whole_opt):
            o.step()
    for m in stacks:
        expected = torch.cat(list(refs[id(m.weight)])).detach()
        torch.testing.assert_close(m.weight.detach(), expected, rtol=0, atol=0)
        assert (m.weight.detach() - whole[id(m.weight)].detach()).abs().max() > 1e-3  # the old, whole-stack step


def test_groups_without_a_role_go_by_shape() -> None:
    """Library use (no roles): 2-D groups go to Muon, the others to AdamW."""
    w, b = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.randn(3))
    opt = OPTIMIZERS["muon"]([{"params": [w], "weight_decay": 0.0}, {"params": [b], "weight_decay": 0.0}])
    assert [g["kind"] for g in opt.param_groups] == ["muon", "adamw"]


@pytest.mark.parametrize("name", ["schedulefree"])  # muon runs sharded (tests/e2e/optim/test_muon.py)
def test_refused_under_fsdp2_naming_the_key(name: str) -> None:
    with pytest.raises(ValueError, match=f"optim={name} with trainer=fsdp2: .*trainer=ddp"):
        validate_optim({"name": name}, {"name": "constant"}, "FSDP2Strategy")
    validate_optim({"name": name}, {"name": "constant"}, "ddp")  # DDP: accepted
