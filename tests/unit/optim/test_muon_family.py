"""The Muon family (optim=muon's keys split, ns_coefficients, normuon): each update against its formula written out
here — Polar Express's five polynomials through the SVD, NorMuon's per-neuron second moment by hand, a fused matrix
split into the matrices torch's Muon would step apart — the cut of every block kind's matrices, a split that does not
fit refused by key before training, and the state a resume continues from."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.optim import OPTIMIZERS, param_groups
from lmlab.optim.muon import NS_COEFFICIENTS, POLAR_EXPRESS, PieceMuon, lr_scale, newton_schulz, pieces, polar_express
from lmlab.run.checks import check_config

TINY = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16)


def _model(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**TINY, **kw}))


def _muon(model: nn.Module, **kw):
    return OPTIMIZERS["muon"](param_groups(model, 0.1, by_role=True, layouts=True), **kw)


def _grads(model: nn.Module, seed: int = 1) -> None:
    torch.manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn_like(p)


def _composed(coefficients, x: torch.Tensor) -> torch.Tensor:
    for a, b, c in coefficients:
        x = a * x + b * x**3 + c * x**5
    return x


def test_polar_express_is_its_five_polynomials_on_the_singular_values() -> None:
    """X₅ = U·p₅(…p₁(σ/(1.02‖G‖_F + 10⁻⁶)))·Vᵀ (an odd polynomial iteration acts on the singular values alone), in
    float64, tall and wide; lmlab's bf16 run is within bf16's rounding of it."""
    torch.manual_seed(0)
    for shape in ((12, 7), (7, 12)):
        g = torch.randn(shape, dtype=torch.float64)
        u, sigma, vh = torch.linalg.svd(g, full_matrices=False)
        scaled = sigma / (g.norm() * 1.02 + 1e-6)
        want = u @ torch.diag(_composed(POLAR_EXPRESS, scaled)) @ vh
        torch.testing.assert_close(polar_express(g, torch.float64), want, rtol=1e-10, atol=1e-10)
        assert (polar_express(g).double() - want).norm() / want.norm() < 0.1  # bf16's 8-bit mantissa, 5 steps: ~7%


def test_polar_express_takes_singular_values_closer_to_one_than_the_quintic() -> None:
    """Over σ ∈ [10⁻³, 1] (the interval its coefficients are optimal on), the five Polar Express steps land every σ
    in [0.846, 1.142]; the quintic's five fixed steps leave σ = 10⁻³ at 0.47 and overshoot to 1.20."""
    s = torch.logspace(-3, 0, 2001, dtype=torch.float64)
    pe, quintic = _composed(POLAR_EXPRESS, s / 1.02), _composed([NS_COEFFICIENTS] * 5, s)
    assert 0.846 < pe.min() < 0.848 and 1.140 < pe.max() < 1.142
    assert 0.47 < quintic.min() < 0.471 and 1.20 < quintic.max() < 1.21
    assert (pe - 1).abs().max() < 0.16 < 0.52 < (quintic - 1).abs().max()


@pytest.mark.parametrize(("kv", "split", "want"), [
    (4, "none", [64 + 32]),  # d 32, 4 heads of 8: q 32 rows, k and v 32 each (kv 4) — one matrix of 96 rows
    (4, "parts", [32, 32, 32]),
    (4, "heads", [8, 8, 8, 8, 8, 8, 8, 8, 32]),
    (4, "head_pairs", [16, 16, 16, 16, 32]),
    (2, "heads", [8, 8, 8, 8, 8, 8, 16]),  # GQA: k has 2 heads, v whole
    (2, "head_pairs", [16, 16, 16, 16]),
])
def test_attentions_fused_projection_is_cut_by_part_head_or_pair(kv: int, split: str, want: list[int]) -> None:
    model = _model(n_kv_head=kv, attention={"name": "gqa" if kv < 4 else "mha"})
    c_attn = model.h[0].attn.c_attn
    groups = param_groups(model, 0.1, by_role=True, layouts=True)
    lay = next(lay for g in groups if g["role"] == "hidden"
               for p, lay in zip(g["params"], g["layouts"], strict=True) if p is c_attn.weight)
    assert pieces(c_attn.weight.size(0), lay, 1, split) == (want if split != "none" else [c_attn.weight.size(0)])


def test_glu_gau_and_experts_are_cut_by_their_blocks() -> None:
    """A GLU's [gate; up] into its two matrices; GAU's [u; v; z] into three (one head: no head cut); an MoE's stacked
    experts one expert at a time with split=none and each expert's gate and up apart with parts."""
    glu = _model(ffn={"name": "swiglu"})
    fc = next(m for m in glu.h[0].modules() if isinstance(m, nn.Linear) and len(getattr(m, "fused", ())) == 2)
    from lmlab.optim import layout

    assert pieces(fc.weight.size(0), layout(fc), 1, "parts") == [fc.weight.size(0) // 2] * 2
    assert pieces(fc.weight.size(0), layout(fc), 1, "heads") == [fc.weight.size(0) // 2] * 2
    gau = _model(block={"name": "gau", "s": 16})
    unit = next(m for m in gau.h[0].modules() if isinstance(m, nn.Linear) and len(getattr(m, "fused", ())) == 3)
    assert pieces(unit.weight.size(0), layout(unit), 1, "head_pairs") == list(unit.fused)
    moe = _model(ffn={"name": "moe", "expert": "swiglu", "n_experts": 4, "top_k": 2, "hidden": 24})
    experts = next(m for m in moe.modules() if getattr(m, "n_experts", 1) > 1 and len(getattr(m, "fused", ())) == 8)
    rows = experts.weight.size(0)
    assert pieces(rows, layout(experts), 4, "none") == [48] * 4
    assert pieces(rows, layout(experts), 4, "parts") == [24] * 8


@pytest.mark.parametrize("adjust", ["match_rms_adamw", "original"])
def test_split_parts_steps_q_k_and_v_as_torchs_muon_steps_three_matrices(adjust: str) -> None:
    """optim.split=parts on a fused QKV: the step equals torch.optim.Muon's on W_q, W_k and W_v held as three
    parameters (their own momentum, Newton–Schulz and s(m_i, n)), two steps."""
    model = _model()
    c_attn = model.h[0].attn.c_attn
    opt = _muon(model, split="parts", adjust_lr_fn=adjust)
    parts = [nn.Parameter(w.detach().clone()) for w in c_attn.weight.split(c_attn.fused)]
    ref = torch.optim.Muon(parts, lr=3e-3, weight_decay=0.1, momentum=0.95, nesterov=True, ns_steps=5,
                           adjust_lr_fn=adjust)
    for seed in (1, 2):
        _grads(model, seed)
        for p, gr in zip(parts, c_attn.weight.grad.split(c_attn.fused), strict=True):
            p.grad = gr.clone()
        opt.step()
        ref.step()
    torch.testing.assert_close(c_attn.weight.detach(), torch.cat([p.detach() for p in parts]), rtol=0, atol=1e-7)


def test_the_default_is_torchs_muon_and_parts_changes_the_update_of_a_fused_matrix() -> None:
    """split=none (the default) keeps torch.optim.Muon for the hidden matrices (every earlier run's step); on a fused
    QKV the parts' update points elsewhere (cosine < 0.95; 0.69 on the default model's first layer) at about the same
    size (s(m, n) = 0.2·√max(m, n) gives every piece AdamW's RMS, the stack as one too)."""
    plain = _muon(_model())
    assert any(isinstance(c, torch.optim.Muon) for c in plain._children.values())
    a, b = _model(), _model()
    wa, wb = a.h[0].attn.c_attn.weight, b.h[0].attn.c_attn.weight
    before = wa.detach().clone()
    opt_a, opt_b = _muon(a), _muon(b, split="parts")
    assert any(isinstance(c, PieceMuon) for c in opt_b._children.values())
    _grads(a), _grads(b)
    opt_a.step(), opt_b.step()
    da, db = (wa.detach() - before * (1 - 3e-4)).flatten(), (wb.detach() - before * (1 - 3e-4)).flatten()
    assert torch.nn.functional.cosine_similarity(da, db, dim=0) < 0.95
    assert 0.9 < db.norm() / da.norm() < 1.1


def test_normuon_by_hand_over_two_steps() -> None:
    """Per row i of the orthogonalised momentum O (quintic NS): v ← 0.95·v + 0.05·mean_j O_ij², Ô = O/(√v + ε),
    Ô·√min(m, n)/‖Ô‖_F, then θ ← θ(1 − lr·wd) − lr·s(m, n)·Ô; written out for a lone 24 × 16 matrix."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.randn(24, 16))
    theta, buf, v = w.detach().clone(), torch.zeros(24, 16), torch.zeros(24, 1)
    opt = PieceMuon([{"params": [w], "weight_decay": 0.1}], lr=0.01, momentum=0.95, nesterov=True, ns_steps=5,
                    adjust_lr_fn="match_rms_adamw", normuon=True)
    for _ in range(2):
        g = torch.randn(24, 16)
        w.grad = g.clone()
        opt.step()
        buf = 0.95 * buf + 0.05 * g
        o = newton_schulz(0.05 * g + 0.95 * buf).float()
        v = 0.95 * v + 0.05 * o.square().mean(dim=1, keepdim=True)
        o_hat = o / (v.sqrt() + 1e-8)
        o_hat = o_hat * math.sqrt(16) / o_hat.norm()
        theta = theta * (1 - 0.01 * 0.1) - 0.01 * 0.2 * math.sqrt(24) * o_hat
        torch.testing.assert_close(w.detach(), theta, rtol=1e-5, atol=1e-6)
    assert opt.state[w]["normuon_v"].shape == (24, 1)
    rms = (o_hat * 0.2 * math.sqrt(24)).square().mean().sqrt()
    assert abs(rms - 0.2) < 1e-5  # the paper's update RMS: 0.2·lr


def test_normuon_evens_out_the_rows_of_an_update() -> None:
    """The point of NorMuon: rows of O with unequal norms come out with equal RMS over steps of the same gradient."""
    torch.manual_seed(0)
    w = nn.Parameter(torch.zeros(8, 32))
    opt = PieceMuon([{"params": [w], "weight_decay": 0.0}], lr=1.0, momentum=0.0, nesterov=False, ns_steps=5,
                    adjust_lr_fn="original", normuon=True, normuon_beta2=0.0)
    g = torch.randn(8, 32) * torch.linspace(0.1, 3, 8)[:, None]
    w.grad = g
    opt.step()
    rows = w.detach().square().mean(dim=1).sqrt()
    unnormed = newton_schulz(g).float().square().mean(dim=1).sqrt()
    assert rows.max() / rows.min() < 1.01 < unnormed.max() / unnormed.min()


@pytest.mark.parametrize("family", [{"split": "heads"}, {"ns_coefficients": "polar_express"},
                                    {"normuon": True, "split": "head_pairs", "ns_coefficients": "polar_express"}])
def test_state_dict_round_trip_continues_exactly(family: dict) -> None:
    """Steps 1–3 straight, and 1–2 then a state_dict into a fresh optimizer over a copied model, then step 3: the
    same bits (NorMuon's second moments and the momentum in the state, the family's keys in the groups)."""
    model = _model(ffn={"name": "moe", "expert": "swiglu", "n_experts": 4, "top_k": 2, "hidden": 24})
    opt = _muon(model, **family)
    for s in (1, 2):
        _grads(model, s)
        opt.step()
    saved, copied = copy.deepcopy(opt.state_dict()), copy.deepcopy(model)
    _grads(model, 3)
    opt.step()
    fresh = _muon(copied, **family)
    fresh.load_state_dict(saved)
    _grads(copied, 3)
    fresh.step()
    for (name, a), b in zip(model.named_parameters(), copied.parameters(), strict=True):
        assert torch.equal(a, b), name


def _cfg(*overrides: str):
    return compose(["trainer.max_steps=500", "optim=muon", *overrides])


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.split=head_pairs", "model.d_model=96", "model.n_head=6", "model.n_kv_head=3", "attention=gqa"],
     "optim.split=head_pairs"),
    (["optim.split=thirds"], "optim.split"),
    (["optim.ns_coefficients=polar_express", "optim.ns_steps=4"], "optim.ns_steps=4"),
    (["optim.normuon_beta2=1.0"], "optim.normuon_beta2"),
])
def test_a_split_or_key_that_does_not_fit_is_refused_before_training(overrides: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_config(_cfg(*overrides))


def test_every_family_key_composes_and_passes_the_checks() -> None:
    cfg = _cfg("optim.split=head_pairs", "optim.ns_coefficients=polar_express", "optim.normuon=true")
    check_config(cfg)
    assert OmegaConf.to_container(cfg.optim)["split"] == "head_pairs"
    assert lr_scale("match_rms_adamw", 16, 32) == pytest.approx(0.2 * math.sqrt(32))


def test_a_checkpoint_stepped_with_another_split_is_refused_naming_the_key() -> None:
    """A state_dict from torch's Muon (before the family: split=none) resumed with optim.split=heads would change the
    run half-way: refused, naming the key and the value that resumes it; with split=none it loads."""
    model = _model()
    old = _muon(model)  # the signature's default: none, as every earlier run
    _grads(model)
    old.step()
    saved = copy.deepcopy(old.state_dict())
    with pytest.raises(ValueError, match=r"stepped with optim\.split=none \(optim\.split=heads now\)"):
        _muon(copy.deepcopy(model), split="heads").load_state_dict(saved)
    _muon(copy.deepcopy(model)).load_state_dict(saved)
    newer = _muon(model, split="heads")
    newer.step()
    with pytest.raises(ValueError, match=r"optim\.split=heads \(optim\.split=none now\)"):
        _muon(copy.deepcopy(model)).load_state_dict(copy.deepcopy(newer.state_dict()))


def test_adam_every_two_steps_the_adamw_half_on_the_summed_gradients_and_resumes_between() -> None:
    """optim.adam_every=2 (record 39): the Muon matrices step every time; the AdamW tensors every other step, by one
    AdamW step on the two steps' summed gradients; the weights and state dict saved between the two (the held
    gradients in it) continue in a fresh optimizer as the uninterrupted one does."""
    model = _model()
    start = copy.deepcopy(model.state_dict())
    opt = _muon(model, adam_every=2)
    adam = [p for g in opt.param_groups if g["kind"] == "adamw" for p in g["params"]]
    muon = [p for g in opt.param_groups if g["kind"] != "adamw" for p in g["params"]]
    summed = {}
    for seed in (1, 2):
        _grads(model, seed)
        for p in adam:
            summed[id(p)] = summed.get(id(p), 0) + p.grad
        before = [p.detach().clone() for p in muon + adam]
        opt.step()
        moved = [not torch.equal(p, b) for p, b in zip(muon + adam, before)]
        assert all(moved[:len(muon)])  # Muon: every step
        assert any(moved[len(muon):]) == (seed == 2)  # AdamW: the second only
        if seed == 1:
            saved = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    ref_model = _model()
    ref_model.load_state_dict(start)
    ref = _muon(ref_model)
    ref_adam = [p for g in ref.param_groups if g["kind"] == "adamw" for p in g["params"]]
    for p_ref, p in zip(ref_adam, adam):
        p_ref.grad = summed[id(p)]
    ref._children["adamw"].step()  # one AdamW step on the sum
    for p_ref, p in zip(ref_adam, adam):
        torch.testing.assert_close(p, p_ref)
    resumed_model = _model()
    resumed_model.load_state_dict(saved[0])
    resumed = _muon(resumed_model, adam_every=2)
    resumed.load_state_dict(saved[1])
    _grads(resumed_model, 2)
    resumed.step()
    for a, b in zip(resumed_model.parameters(), model.parameters()):
        torch.testing.assert_close(a, b)


def test_the_momentum_cools_down_over_the_runs_last_steps() -> None:
    """optim.momentum_cooldown_steps=c (record 39's cool-down): μ rises over the warm-up, holds, and falls back to
    momentum_start linearly over the last c of N steps: the record's get_muon_momentum, step by step."""
    model = _model()
    opt = _muon(model, momentum=0.95, momentum_start=0.85, momentum_warmup_steps=3, momentum_cooldown_steps=4)
    opt.set_max_steps(10)

    def record(step: int) -> float:  # modded-nanogpt's get_muon_momentum with N = 10, warm-up 3, cool-down 4
        cd_start = 10 - 4
        if step < 3:
            return 0.85 + step / 3 * 0.1
        if step > cd_start:
            return 0.95 - (step - cd_start) / 4 * 0.1
        return 0.95

    seen = []
    for _ in range(10):
        _grads(model)
        opt.step()
        seen.append(next(g["momentum"] for g in opt.param_groups if g["kind"] == "muon"))
    assert seen == pytest.approx([record(s) for s in range(10)])
