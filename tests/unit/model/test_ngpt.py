"""norm=ngpt, the normalized Transformer (arXiv 2410.01131): the update, the attention, the FFN and the logits against
the paper's equations written out on a small model (the learned scales away from their inits, so a formula that
drops one fails), numbers for the update rule and the eigen-rate scaling trick, every hidden state and every matrix on
the unit sphere (at init, and again after an optimizer step), causality, cached generation, no weight decay, the
refusals by key, and `norm=ngpt` composing from its YAML."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.model.ngpt import NGPT, EigenUpdate
from lmlab.optim import param_groups
from tests.unit.model.options import assert_cached_equals_full, assert_refused

V, T, B, D = 40, 12, 2, 32
BASE = dict(vocab_size=V, n_layer=2, d_model=D, n_head=4, max_seq_len=16, norm={"name": "ngpt"},
            position={"name": "rope"}, ffn={"name": "swiglu", "hidden_mult": 4, "multiple_of": 32})
SCALES = ("alpha", "s_qk", "s_u", "s_v", "s_z")  # nGPT's learned vectors, by parameter name


def _model(seed: int = 0, **over) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**BASE, **over}))


def _randomise_scales(model: GPT) -> None:
    """Every learned vector of nGPT times a factor in [0.5, 1.5) per entry: off its init, different per channel."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.split(".")[-1] in SCALES:
                p.mul_(torch.rand_like(p) + 0.5)


def _unit(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return x / x.norm(dim=dim, keepdim=True)


def _matrices(model: GPT) -> dict[str, tuple[torch.Tensor, int]]:
    """Each matrix with the dimension that must be unit: rows (dim 1) of what reads the stream, columns (dim 0) of what
    writes into it."""
    out = {"wte": (model.wte.weight, 1), "lm_head": (model.lm_head.weight, 1)}
    if hasattr(model.pos, "wpe"):
        out["wpe"] = (model.pos.wpe.weight, 1)
    for i, block in enumerate(model.h):
        out |= {f"{i}.c_attn": (block.attn.c_attn.weight, 1), f"{i}.attn.c_proj": (block.attn.c_proj.weight, 0),
                f"{i}.c_fc": (block.mlp.c_fc.weight, 1), f"{i}.mlp.c_proj": (block.mlp.c_proj.weight, 0)}
    return out


def test_the_norm_is_x_over_its_length() -> None:
    norm = NGPT(4)
    x = torch.tensor([[3.0, 4.0, 0.0, 0.0], [0.0, 0.0, 0.0, -2.0]])
    torch.testing.assert_close(norm(x), torch.tensor([[0.6, 0.8, 0.0, 0.0], [0.0, 0.0, 0.0, -1.0]]))
    assert list(norm.parameters()) == []  # no gain: nGPT has no norm layer to learn
    assert norm(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_the_update_rule_in_numbers() -> None:
    """h ← Norm(h + α_j ⊙ (Norm(F_j(h)) − h)) for two sublayers with per-channel α, worked by hand in 2-D:
    h = (1, 0), F_1 = (0, 2) → Norm (0, 1), α_1 = (.5, .5): Norm(.5, .5) = (1/√2, 1/√2); F_2(h) = (−3h₁, 0) →
    Norm (−1, 0), α_2 = (.25, .75): Norm(1/√2 − .25(1 + 1/√2), .25/√2) = (0.84586, 0.53340)."""
    wiring = EigenUpdate(2, 2, init=0.05, scale=0.5)
    assert wiring.alpha_mult == pytest.approx(0.1)
    with torch.no_grad():
        wiring.alpha.copy_(torch.tensor([[5.0, 5.0], [2.5, 7.5]]))  # α = param · 0.05/0.5
    torch.testing.assert_close(wiring.rates(), torch.tensor([[0.5, 0.5], [0.25, 0.75]]))

    class Block:
        def norm(self, j: int) -> NGPT:
            return NGPT(2)

    fs = [(1, lambda h: torch.tensor([[0.0, 2.0]])), (2, lambda h: h * torch.tensor([-3.0, 0.0]))]
    out = wiring.wire(Block(), torch.tensor([[1.0, 0.0]]), fs)
    torch.testing.assert_close(out, torch.tensor([[0.8458618, 0.5334021]]), rtol=0, atol=1e-6)


def test_the_eigen_rates_scaling_trick() -> None:
    """Each vector is a parameter at its storage scale read times init/scale: α starts at alpha_init (0.05) from a
    parameter at 1/√d_model, so one Adam step of lr η (size η on the parameter) moves α by η·0.05·√d; s_qk and s_z
    start at 1 from 1/√d, s_u and s_v at 1 from 1 (the paper's scales). Keys move both."""
    model = _model()
    alpha = model.h[0].ngpt
    torch.testing.assert_close(alpha.alpha.detach(), torch.full((2, D), D ** -0.5))
    torch.testing.assert_close(alpha.rates().detach(), torch.full((2, D), 0.05))
    qk, ffn = model.h[1].attn.qk_map, model.h[1].mlp.hidden_scale
    torch.testing.assert_close(qk.s_qk.detach(), torch.full((4, 8), D ** -0.5))
    torch.testing.assert_close(qk.s_qk * qk.s_qk_mult, torch.ones(4, 8), check_stride=False)
    torch.testing.assert_close(model.norm_model.s_z * model.norm_model.s_z_mult, torch.ones(V))
    assert ffn.s_u.detach().eq(1).all() and ffn.s_v.detach().eq(1).all() and ffn.s_mult == 1.0

    opt = torch.optim.Adam([alpha.alpha], lr=1e-3)
    alpha.rates().sum().backward()  # Adam's first step: lr · sign(grad) on the parameter
    opt.step()
    torch.testing.assert_close(alpha.rates().detach(), torch.full((2, D), 0.05 - 1e-3 * 0.05 * math.sqrt(D)),
                               rtol=0, atol=1e-7)

    keyed = _model(norm={"name": "ngpt", "alpha_init": 0.1, "alpha_scale": 0.5, "sqk_init": 2.0})
    torch.testing.assert_close(keyed.h[0].ngpt.alpha.detach(), torch.full((2, D), 0.5))
    torch.testing.assert_close(keyed.h[0].ngpt.rates().detach(), torch.full((2, D), 0.1))
    torch.testing.assert_close((keyed.h[0].attn.qk_map.s_qk * keyed.h[0].attn.qk_map.s_qk_mult).detach(),
                               torch.full((4, 8), 2.0))


def test_a_block_is_the_paper_update() -> None:
    """Block 0's output from its input written out: h_A = Attn(h), h ← Norm(h + α_A(Norm(h_A) − h)), then the same
    with the MLP and α_M, α = the stored parameter × 0.05·√d (no norm before either sublayer)."""
    model = _model().eval()
    _randomise_scales(model)
    seen = {}
    model.h[0].register_forward_hook(lambda m, args, out: seen.update(h=args[0], out=out))
    with torch.no_grad():
        model(torch.randint(0, V, (B, T)))
        block, h = model.h[0], seen["h"]
        a_attn, a_mlp = block.ngpt.alpha * 0.05 * math.sqrt(D)
        h = _unit(h + a_attn * (_unit(block.attn(h, model.pos)) - h))
        h = _unit(h + a_mlp * (_unit(block.mlp(h)) - h))
    torch.testing.assert_close(seen["out"], h, rtol=1e-5, atol=1e-6)


def test_every_hidden_state_is_on_the_unit_sphere() -> None:
    """The embedding output (learned positions added: its sum normalised) and every block's output have norm 1, with
    the scales away from init and the weights moved by training steps; no final norm is left before the head."""
    model = _model(position={"name": "learned"}).train()
    _randomise_scales(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    idx = torch.randint(0, V, (B, T))
    for _ in range(3):
        model(idx, targets=idx.roll(-1, 1)).backward()
        opt.step()
        opt.zero_grad()
        model.normalize_weights()
    states = []
    for block in model.h:
        block.register_forward_pre_hook(lambda m, args: states.append(args[0]))
    model.h[-1].register_forward_hook(lambda m, args, out: states.append(out))
    with torch.no_grad():
        model(idx)
    assert len(states) == 3 and isinstance(model.ln_f, torch.nn.Identity)
    for h in states:
        torch.testing.assert_close(h.norm(dim=-1), torch.ones(B, T), rtol=0, atol=1e-5)


@pytest.mark.parametrize("tie", [True, False])
def test_every_matrix_is_unit_at_init_and_again_after_a_step(tie: bool) -> None:
    """At init and after `normalize_weights` (what the loop calls after every step) each matrix's d_model-vectors have
    norm 1: rows of the embeddings, the head, W_q/W_k/W_v and the FFN's up and gate, columns of both W_o. The step
    itself moves them off; the learned vectors (α, s_qk, s_u, s_v, s_z) are left alone."""
    model = _model(position={"name": "learned"}, tie_embeddings=tie)
    for name, (w, dim) in _matrices(model).items():
        torch.testing.assert_close(w.norm(dim=dim), torch.ones(w.size(1 - dim)), rtol=0, atol=1e-6, msg=name)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    idx = torch.randint(0, V, (B, T))
    model(idx, targets=idx.roll(-1, 1)).backward()
    opt.step()
    assert any((w.norm(dim=dim) - 1).abs().max() > 1e-3 for w, dim in _matrices(model).values())
    scales = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 1 or "alpha" in n}
    model.normalize_weights()
    for name, (w, dim) in _matrices(model).items():
        torch.testing.assert_close(w.norm(dim=dim), torch.ones(w.size(1 - dim)), rtol=0, atol=1e-6, msg=name)
    for n, p in model.named_parameters():
        if n in scales:
            assert torch.equal(p, scales[n]), n


@pytest.mark.parametrize("kv", [4, 2])
def test_attention_is_the_paper_formula(kv: int) -> None:
    """Attn(h) by hand: q, k, v from W_qkv, RoPE, then q ← Norm(q)·s_qk and k ← Norm(k)·s_qk per head (s_qk per
    key/value head and dim: GQA's query heads share their key head's), weights softmax(√d_k · q·k) causal, W_o. The
    logit scale is √d_k = √8, not 1/√8."""
    model = _model(attention={"name": "gqa" if kv < 4 else "mha"}, n_kv_head=kv).eval()
    _randomise_scales(model)
    attn, hd, nh = model.h[0].attn, 8, 4
    assert attn.scale == pytest.approx(math.sqrt(hd))
    x = _unit(torch.randn(B, T, D))
    with torch.no_grad():
        q, k, v = (x @ attn.c_attn.weight.T).split([nh * hd, kv * hd, kv * hd], dim=-1)
        q, k, v = (t.view(B, T, -1, hd).transpose(1, 2) for t in (q, k, v))
        q, k = model.pos.rotate(q, k)
        s = attn.qk_map.s_qk * math.sqrt(D)  # (kv, hd): init 1 stored at 1/√d
        k = _unit(k) * s[:, None]
        q = _unit(q) * s.repeat_interleave(nh // kv, dim=0)[:, None]
        k, v = (t.repeat_interleave(nh // kv, dim=1) for t in (k, v))
        logits = math.sqrt(hd) * q @ k.transpose(-1, -2)
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        y = (logits.softmax(-1) @ v).transpose(1, 2).reshape(B, T, nh * hd)
        torch.testing.assert_close(attn(x, model.pos), y @ attn.c_proj.weight.T, rtol=1e-5, atol=1e-6)
        s_first = attn.qk_map.s_qk.clone()
        attn.qk_map.s_qk.copy_(s_first * 2)  # s_qk multiplies q and k both: the logits × 4
        assert not torch.allclose(attn(x, model.pos), y @ attn.c_proj.weight.T, atol=1e-4)


@pytest.mark.parametrize("ffn", ["swiglu", "mlp"])
def test_the_ffn_is_the_paper_formula(ffn: str) -> None:
    """SwiGLU: u = W_u h · s_u, v = W_v h · s_v · √d_model, W_o (u ⊙ SiLU(v)); the MLP (GELU) scales its one part as the
    gate: W_o act(W_1 h · s_v · √d_model)."""
    model = _model(ffn={"name": ffn, "hidden_mult": 4, "multiple_of": 32}).eval()
    _randomise_scales(model)
    mlp = model.h[0].mlp
    x = _unit(torch.randn(B, T, D))
    with torch.no_grad():
        h = x @ mlp.c_fc.weight.T
        s_v = mlp.hidden_scale.s_v * math.sqrt(D)
        if ffn == "swiglu":
            v, u = h.chunk(2, dim=-1)  # c_fc's rows: [gate; up]
            expected = (u * mlp.hidden_scale.s_u * F.silu(v * s_v)) @ mlp.c_proj.weight.T
        else:
            assert mlp.hidden_scale.s_u is None
            expected = F.gelu(h * s_v) @ mlp.c_proj.weight.T
        torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunked", [False, True])
def test_the_logits_are_s_z_times_the_head(chunked: bool) -> None:
    """z = s_z ⊙ (E_out h_L), h_L the last block's output, read with no final norm; s_z per vocabulary entry, stored at
    1/√d for 1. The loss on the chunked path is the same cross-entropy."""
    model = _model(tie_embeddings=False, chunked_loss=chunked).eval()
    _randomise_scales(model)
    seen = {}
    model.h[-1].register_forward_hook(lambda m, args, out: seen.update(h=out))
    idx, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
    with torch.no_grad():
        logits = model(idx)
        expected = model.norm_model.s_z * math.sqrt(D) * (seen["h"] @ model.lm_head.weight.T)
        loss = model(idx, targets=targets)
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(loss, F.cross_entropy(expected.flatten(0, 1), targets.flatten()), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_causal(mode: str) -> None:
    """Changing the tokens after position t leaves the logits up to t unchanged (and changes the later ones)."""
    model = _model(position={"name": "learned"}).train(mode == "train")
    _randomise_scales(model)
    idx = torch.randint(0, V, (B, T))
    later = idx.clone()
    later[:, 6:] = (idx[:, 6:] + 1 + torch.randint(0, V - 1, (B, T - 6))) % V
    with torch.no_grad():
        a, b = model(idx), model(later)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(a[:, 6:], b[:, 6:], atol=1e-4)


@pytest.mark.parametrize("over", [
    {}, {"attention": {"name": "gqa"}, "n_kv_head": 2}, {"position": {"name": "learned"}},
    {"position": {"name": "alibi"}, "ffn": {"name": "mlp", "hidden_mult": 4, "multiple_of": 32}},
    {"attention": {"name": "mha", "window": 4}},
    {"position": {"name": "rope", "rotary_pct": 0.5}, "attention": {"name": "mha", "key_offset": True}},
], ids=["rope", "gqa", "learned", "alibi-mlp", "window", "key_offset"])
def test_cached_generation_equals_the_full_forward(over: dict) -> None:
    """The KV cache holds the keys after the sphere and s_qk, as the logits read them."""
    model = _model(**over)
    _randomise_scales(model)
    assert_cached_equals_full(model, torch.randint(0, V, (B, 14)))


def test_it_trains_and_every_scale_learns() -> None:
    """AdamW steps with the weights put back on the sphere after each (the loop's order) fit one batch: the loss falls
    by more than a nat, and at the first step every learned vector gets a gradient."""
    model = _model(position={"name": "learned"}, tie_embeddings=False)
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2)
    idx = torch.randint(0, V, (4, T))
    losses = []
    for _ in range(40):
        loss = model(idx, targets=idx.roll(-1, 1))
        opt.zero_grad()
        loss.backward()
        if not losses:
            scales = {n: p for n, p in model.named_parameters() if n.split(".")[-1] in SCALES}
            assert len(scales) == 1 + 4 * len(model.h), sorted(scales)  # s_z; α, s_qk, s_u, s_v per block
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in scales.values()), sorted(scales)
        opt.step()
        model.normalize_weights()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0, losses


def test_the_initial_loss_is_about_log_vocab() -> None:
    """Unit vectors give logits of about ±1/√d · s_z (= 1): close to uniform, the loss near ln V."""
    model = _model().eval()
    with torch.no_grad():
        loss = model(torch.randint(0, V, (4, T)), targets=torch.randint(0, V, (4, T)))
    assert loss.item() == pytest.approx(math.log(V), abs=0.1)


@pytest.mark.parametrize("by_role", [False, True])
def test_no_weight_decay_anywhere(by_role: bool) -> None:
    """Its matrices are renormalised after every step, so they take no decay: every group at weight decay 0, the
    groups otherwise as every model's (by role, the blocks' Linear weights are the hidden group Muon orthogonalises)."""
    model = _model()
    assert not model.decays and _model(norm={"name": "rms"}).decays
    groups = param_groups(model, 0.1, by_role=by_role)
    assert {g["weight_decay"] for g in groups} == {0.0}
    if by_role:
        hidden = next(g for g in groups if g["role"] == "hidden")["params"]
        linear = {id(m.weight) for m in model.h.modules() if isinstance(m, torch.nn.Linear)}
        assert {id(p) for p in hidden} == linear


# ---- refusals, and the YAML ---------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides,message", [
    (["placement=post"], "norm=ngpt with placement=post: it wires each block itself"),
    (["block=gau"], "norm=ngpt with block=gau"),
    (["mixer=gdn", "mixer.pattern=[gdn,attention]"], "norm=ngpt with mixer=gdn"),
    (["attention=diff"], r"norm=ngpt with attention=diff: .*use attention=mha\|gqa\|mqa"),
    (["attention=cosine"], "norm=ngpt with attention=cosine"),
    (["attention.qk_norm=true"], "norm=ngpt with attention.qk_norm=true: nGPT normalises q and k itself"),
    (["attention.mem_kv=2"], "norm=ngpt with attention.mem_kv=2"),
    (["position=sinusoidal"], "norm=ngpt with position=sinusoidal"),
    (["position=xpos"], "norm=ngpt with position=xpos"),
    (["residual=x0"], "norm=ngpt with residual=x0: .*use residual=standard"),
    (["residual=value_residual"], "norm=ngpt with residual=value_residual"),
    (["param=mup"], "norm=ngpt with param=mup"),
    (["head=mtp"], "norm=ngpt with head=mtp"),
    (["ffn=moe"], "norm=ngpt with ffn=moe"),
    (["mixer.pattern=[none,attention]"], "norm=ngpt with mixer.pattern dropping a sublayer"),
    (["ffn.skip_layers=[0]"], "norm=ngpt with ffn.skip_layers dropping a sublayer"),
    (["model.bias=true"], r"norm=ngpt with model.bias=true: .*use model.bias=false"),
    (["model.dropout=0.1"], "norm=ngpt with model.dropout=0.1"),
    (["model.embed_scale=sqrt_d"], "norm=ngpt with model.embed_scale=sqrt_d"),
    (["optim.ema=0.99"], r"norm=ngpt with optim.ema=0.99: an average of unit vectors is off the sphere"),
    (["optim=schedulefree"], "norm=ngpt with optim=schedulefree"),
    (["optim.qk_clip=50"], "norm=ngpt with optim.qk_clip=50"),
    (["trainer=fsdp2", "trainer.accelerator=cpu", "trainer.devices=2"], "norm=ngpt with trainer=fsdp2"),
    (["norm.alpha_init=0"], "norm.alpha_init"),
], ids=lambda v: v[0] if isinstance(v, list) else None)
def test_refused_by_key_before_training(overrides: list[str], message: str) -> None:
    assert_refused(["norm=ngpt", *overrides], message)


def test_export_to_transformers_is_refused_by_the_norm() -> None:
    from lmlab.interop.hf import NotRepresentable, to_hf

    with pytest.raises(NotRepresentable, match="^norm='ngpt'"):
        to_hf(_model())


def test_norm_ngpt_composes_from_its_yaml() -> None:
    """`norm=ngpt` alone (the default model, placement, learned positions, GELU MLP) passes the checks, saying that
    optim.weight_decay does not apply, and builds an nGPT: every block wired by it, the keys from its YAML."""
    from lmlab import build_model, compose
    from lmlab.run.checks import check_config

    cfg = compose(["norm=ngpt"])
    assert dict(cfg.norm) == {"name": "ngpt", "alpha_init": 0.05, "alpha_scale": None, "sqk_init": 1.0,
                              "sqk_scale": None, "suv_init": 1.0, "suv_scale": 1.0, "sz_init": 1.0, "sz_scale": None}
    with pytest.warns(UserWarning, match=r"optim.weight_decay=0.1 does not apply under norm=ngpt"):
        check_config(cfg)
    model = build_model(cfg, vocab_size=V)
    assert all(isinstance(block.ngpt, EigenUpdate) and block.wiring == "ngpt" for block in model.h)
    d = cfg.model.d_model
    torch.testing.assert_close(model.h[0].ngpt.alpha.detach(), torch.full((2, d), d ** -0.5))
