"""The residual axis: each connection against its equation computed directly on a small model (the blocks' inputs and
outputs read by hooks), `scaled` at zero init exactly the identity, `parallel` as the formula, gradients under
activation checkpointing, the options stacked, and the refusals by key."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT, validate
from lmlab.model.residual import RESIDUALS

V = 40


def _model(residual: dict, **kw) -> GPT:
    base = dict(vocab_size=V, n_layer=4, d_model=32, n_head=4, max_seq_len=16, position={"name": "rope"},
                norm={"name": "rms"}, residual=residual)
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(**{**base, **kw}))).eval()
    with torch.no_grad():  # the learned scalars away from their inits, so that a wrong index shows
        for name, p in model.named_parameters():
            if name.startswith("residual.") or "branch_scale" in name or "value_mixes" in name:
                p.copy_(torch.rand_like(p) + 0.25)
    return model


def _idx(T: int = 12) -> torch.Tensor:
    return torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(1))


def _trace(model: GPT, idx: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Every block's input and output in one forward, and the embedding output x0."""
    ins, outs = [], []
    hooks = [b.register_forward_pre_hook(lambda m, a: ins.append(a[0])) for b in model.h]
    hooks += [b.register_forward_hook(lambda m, a, o: outs.append(o)) for b in model.h]
    with torch.no_grad():
        model(idx)
        x0 = model.drop(model.pos.embed(model.wte(idx)))
    for h in hooks:
        h.remove()
    return ins, outs, x0


def test_standard_is_the_default_and_changes_nothing() -> None:
    assert compose([]).residual == {"standard": {}}
    plain, standard = _model({}), _model({"standard": {}})
    with torch.no_grad():
        torch.testing.assert_close(plain(_idx()), standard(_idx()), rtol=0, atol=0)


def test_scaled_with_zero_branches_is_exactly_the_identity_at_step_0() -> None:
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(vocab_size=V, n_layer=3, d_model=32, n_head=4, max_seq_len=16,
                                   residual={"scaled": {"branch_init": 0.0}})))
    ins, outs, x0 = _trace(model, _idx())
    for x_in, x_out in zip(ins, outs):
        assert torch.equal(x_in, x0) and torch.equal(x_out, x0)  # ReZero: every block passes its input through


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("placement", ["pre", "post", "double"])
def test_scaled_is_its_formula(per_channel: bool, placement: str) -> None:
    """pre: x + α_j·F_j(N_j(x)); post: N_j(x + α_j·F_j(x)); double: x + α_j·N'_j(F_j(N_j(x))); with the stream scalar
    λ_l on each layer's input."""
    model = _model({"scaled": {"per_channel": per_channel, "stream": True}}, placement={"name": placement})
    ins, outs, x0 = _trace(model, _idx())
    lam = model.residual.options["scaled"].stream
    with torch.no_grad():
        for i, block in enumerate(model.h):
            prev = x0 if i == 0 else outs[i - 1]
            x = lam[i] * prev
            torch.testing.assert_close(ins[i], x)  # the block's input: λ_l times the last block's output
            alpha = block.branch_scale.alpha
            for j, f in ((1, lambda h: block.attn(h, model.pos)), (2, block.mlp)):
                if placement == "pre":
                    x = x + alpha[j - 1] * f(block.norm(j)(x))
                elif placement == "post":
                    x = block.norm(j)(x + alpha[j - 1] * f(x))
                else:
                    x = x + alpha[j - 1] * block.norm(j, post=True)(f(block.norm(j)(x)))
            torch.testing.assert_close(outs[i], x, rtol=1e-5, atol=1e-5)


def test_scaled_unscaled_mixer_leaves_the_attention_branch_of_those_layers_bare() -> None:
    """Record 74: in the listed layers x + A(N(x)) then + α·F(N(x)) for the FFN, the other layers as before; a layer
    whose only sublayer is its attention keeps no scalars at all."""
    model = _model({"scaled": {"unscaled_mixer": [0, 2]}})
    ins, outs, x0 = _trace(model, _idx())
    with torch.no_grad():
        for i, block in enumerate(model.h):
            x = x0 if i == 0 else outs[i - 1]
            alpha = block.branch_scale.alpha
            assert alpha.shape == ((1, 1) if i in (0, 2) else (2, 1))
            a_attn, a_mlp = (1.0, alpha[0]) if i in (0, 2) else (alpha[0], alpha[1])
            x = x + a_attn * block.attn(block.norm(1)(x), model.pos)
            x = x + a_mlp * block.mlp(block.norm(2)(x))
            torch.testing.assert_close(outs[i], x, rtol=1e-5, atol=1e-5)
    alone = _model({"scaled": {"unscaled_mixer": [0]}}, ffn={"name": "mlp", "skip_layers": [0]})
    assert not hasattr(alone.h[0], "branch_scale") and alone.h[1].branch_scale.alpha.shape == (2, 1)


def test_value_residual_mixes_each_layers_values_with_the_first_layers() -> None:
    """Layer l's attention computed by hand from its own q, k and the values (1 − λ_l)·v_l + λ_l·v_1, v_1 the first
    layer's values of the same tokens."""
    model = _model({"value_residual": {"init": 0.3}}, n_layer=3, position={"name": "none"})
    ins, outs, x0 = _trace(model, _idx())
    nh, hs = 4, 8

    def heads(t):
        return t.view(2, -1, nh, hs).transpose(1, 2)

    with torch.no_grad():
        v_first = None
        for i, block in enumerate(model.h):
            h = block.ln_1(ins[i])
            q, k, v = block.attn.c_attn(h).split(block.attn.c_attn.fused, dim=-1)
            q, k, v = heads(q), heads(k), heads(v)
            if i == 0:
                v_first = v
            else:
                lam = block.attn.value_mixes[0].lam
                assert lam.requires_grad and 0.25 <= float(lam) < 1.25  # learned, set away from init above
                v = (1 - lam) * v + lam * v_first
            T = q.size(-2)
            logits = q @ k.transpose(-2, -1) / hs ** 0.5
            logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            y = (logits.softmax(-1) @ v).transpose(1, 2).reshape(2, T, nh * hs)
            a = block.attn.c_proj(y)
            x = ins[i] + a
            torch.testing.assert_close(outs[i], x + block.mlp(block.ln_2(x)), rtol=1e-5, atol=1e-5)


def test_value_residual_fixed_keeps_resformers_equal_mix() -> None:
    model = GPT(validate(GPTConfig(vocab_size=V, n_layer=2, d_model=32, n_head=4, max_seq_len=16,
                                   residual={"value_residual": {"learned": False}})))
    lam = model.h[1].attn.value_mixes[0].lam
    assert not lam.requires_grad and float(lam) == 0.5
    assert not any("lam" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("gate_channels", [0, 3])
def test_value_embeddings_are_added_to_the_values_of_their_layers(gate_channels: int) -> None:
    """v_l ← λ_l·v_l + μ_l·E_t(idx) on the layers that read table t: layer i and layer L − tables + i share table i;
    with gate_channels k (record 55) v_l ← v_l + 2σ(W_l·x_{:k})·E_t(idx), a gate per head from the attention's input."""
    from lmlab.model.residual.value_embed import ValueEmbed

    assert ValueEmbed.assignment(6, 2, None) == {0: 0, 1: 1, 4: 0, 5: 1}
    assert ValueEmbed.assignment(4, 3, None) == {0: 0, 1: 1, 2: 2, 3: 2}  # layer 1 is in both halves: table 1 once
    assert ValueEmbed.assignment(4, 3, [3, 0]) == {3: 0, 0: 1}
    assert ValueEmbed.assignment(12, 3, [[0, 11], [1, 10], [2, 9]]) == {0: 0, 11: 0, 1: 1, 10: 1, 2: 2, 9: 2}  # #15
    model = _model({"value_embed": {"tables": 2, "gate_channels": gate_channels}}, n_layer=5, position={"name": "none"})
    idx = _idx()
    ins, outs, x0 = _trace(model, idx)
    tables = model.residual.options["value_embed"].tables
    nh, hs = 4, 8

    def heads(t):
        return t.view(2, -1, nh, hs).transpose(1, 2)

    with torch.no_grad():
        for i, block in enumerate(model.h):
            q, k, v = (heads(t) for t in block.attn.c_attn(block.ln_1(ins[i])).split(block.attn.c_attn.fused, dim=-1))
            table = {0: 0, 1: 1, 3: 0, 4: 1}.get(i)
            if table is None:
                assert not block.attn.value_mixes
            elif gate_channels:
                w = block.attn.value_mixes[0].gate  # (nh, k)
                g = 2 * torch.sigmoid(block.ln_1(ins[i])[..., :gate_channels] @ w.T)  # (B, T, nh)
                v = v + g.transpose(1, 2).unsqueeze(-1) * heads(tables[table](idx))
            else:
                lam = block.attn.value_mixes[0].lambdas
                v = lam[0] * v + lam[1] * heads(tables[table](idx))
            T = q.size(-2)
            logits = (q @ k.transpose(-2, -1) / hs ** 0.5).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1),
                                                                         float("-inf"))
            x = ins[i] + block.attn.c_proj((logits.softmax(-1) @ v).transpose(1, 2).reshape(2, T, nh * hs))
            torch.testing.assert_close(outs[i], x + block.mlp(block.ln_2(x)), rtol=1e-5, atol=1e-5)


def test_value_embeddings_are_counted_in_the_size_estimate() -> None:
    from lmlab.model.resolve import n_params_estimate

    cfg = GPTConfig(vocab_size=500, n_layer=4, d_model=32, n_head=4, residual={"value_embed": {"tables": 2}})
    with torch.device("meta"):
        built = GPT(cfg).num_params()
    assert n_params_estimate(cfg) <= built <= 1.01 * n_params_estimate(cfg)
    assert n_params_estimate(cfg) - n_params_estimate(GPTConfig(vocab_size=500, n_layer=4, d_model=32, n_head=4)) >= (
        2 * 500 * 32)


def test_x0_reinjects_the_embedding_output() -> None:
    model = _model({"x0": {}})
    ins, outs, x0 = _trace(model, _idx())
    lam = model.residual.options["x0"].lambdas
    torch.testing.assert_close(ins[0], x0)
    for i in range(1, 4):
        torch.testing.assert_close(ins[i], outs[i - 1] + lam[i] * x0, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("n_layer", [4, 5])
def test_unet_adds_layer_L_minus_1_minus_is_output_into_the_second_half(n_layer: int) -> None:
    model = _model({"unet": {}}, n_layer=n_layer)
    ins, outs, x0 = _trace(model, _idx())
    gates = model.residual.options["unet"].gates
    first = (n_layer + 1) // 2
    assert gates.numel() == n_layer - first
    for i in range(1, n_layer):
        want = outs[i - 1] if i < first else outs[i - 1] + gates[i - first] * outs[n_layer - 1 - i]
        torch.testing.assert_close(ins[i], want, rtol=1e-6, atol=1e-6)


def test_unet_chosen_pairs_with_sigmoid_gates_add_sigma_w_times_the_sources_output() -> None:
    """Record 45's one skip (here [1, 3] of 4 layers, and [0, 2]) with record 32's σ gates: layer r's input is layer
    r − 1's output plus σ(w)·(layer s's output); every other input is the previous output alone."""
    model = _model({"unet": {"pairs": [[1, 3], [0, 2]], "gate": "sigmoid"}})
    ins, outs, _ = _trace(model, _idx())
    unet = model.residual.options["unet"]
    w = unet.gates.detach()
    assert unet.receivers == [2, 3] and w.numel() == 2
    torch.testing.assert_close(ins[1], outs[0])
    torch.testing.assert_close(ins[2], outs[1] + torch.sigmoid(w[0]) * outs[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ins[3], outs[2] + torch.sigmoid(w[1]) * outs[1], rtol=1e-6, atol=1e-6)
    assert GPT(validate(GPTConfig(vocab_size=V, n_layer=4, d_model=32, n_head=4, max_seq_len=16, residual={
        "unet": {"gate": "sigmoid", "gate_init": -1.5}}))).residual.options["unet"].gate(3).item() == \
        pytest.approx(1 / (1 + math.exp(1.5)))  # record 32: σ(−1.5) ≈ 0.18


def test_unet_gate_channels_scale_each_skip_by_two_sigma_of_the_embedding_output() -> None:
    """Record 55's skip gate: layer r's input gets σ(w)·2σ(u_r·x0_{:k})·(layer s's output), per token."""
    model = _model({"unet": {"pairs": [[1, 3]], "gate": "sigmoid", "gate_channels": 5}})
    ins, outs, x0 = _trace(model, _idx())
    unet = model.residual.options["unet"]
    g = torch.sigmoid(unet.gates[0]) * 2 * torch.sigmoid(x0[..., :5] @ unet.inputs[0]).unsqueeze(-1)
    torch.testing.assert_close(ins[3], outs[2] + g.detach() * outs[1], rtol=1e-6, atol=1e-6)
    fresh = GPT(validate(GPTConfig(vocab_size=V, n_layer=4, d_model=32, n_head=4, max_seq_len=16,
                                   residual={"unet": {"gate_channels": 5}})))
    assert not fresh.residual.options["unet"].inputs.any()  # from zero: a factor of 1 at init


def test_scaled_stream_init_starts_every_lambda_there() -> None:
    model = GPT(validate(GPTConfig(vocab_size=V, n_layer=3, d_model=32, n_head=4, max_seq_len=16,
                                   residual={"scaled": {"stream": True, "stream_init": 1.1}})))
    assert torch.equal(model.residual.options["scaled"].stream.detach(), torch.full((3,), 1.1))


@pytest.mark.parametrize("placement", ["pre", "double", "post_nonres"])
def test_parallel_sums_both_branches_of_the_same_input(placement: str) -> None:
    model = _model({"parallel": {}}, placement={"name": placement})
    ins, outs, _ = _trace(model, _idx())
    with torch.no_grad():
        for i, block in enumerate(model.h):
            x = ins[i]
            attn = block.branch(x, lambda h: block.attn(h, model.pos), 1)
            torch.testing.assert_close(outs[i], x + attn + block.branch(x, block.mlp, 2), rtol=1e-6, atol=1e-6)
        pre = model.h[0]
        if placement == "pre":  # GPT-NeoX / PaLM: x + Attn(N1(x)) + FFN(N2(x))
            x = ins[0]
            torch.testing.assert_close(outs[0], x + pre.attn(pre.ln_1(x), model.pos) + pre.mlp(pre.ln_2(x)),
                                       rtol=1e-6, atol=1e-6)


def test_hyper_connections_with_one_stream_and_static_weights_are_the_standard_stream() -> None:
    standard = _model({})
    hyper = GPT(validate(GPTConfig(**{**standard.cfg.inputs(), "residual": {"hyper": {"streams": 1,
                                                                                       "dynamic": False}}})))
    hyper.load_state_dict(standard.state_dict(), strict=False)  # the same weights; the connections at their init
    assert not hyper.residual.options["hyper"].dynamic
    with torch.no_grad():
        torch.testing.assert_close(hyper.eval()(_idx()), standard(_idx()), rtol=1e-6, atol=1e-6)


def test_hyper_connections_are_the_papers_update() -> None:
    """Each sublayer k: h = Σ_i α_i0 H_i, y = branch(h), H'_j = Σ_i α_i(1+j) H_i + β_j y, with α = static +
    s·tanh(RMSNorm(H) W) per token (and β likewise), written out stream by stream."""
    model = _model({"hyper": {"streams": 3}}, n_layer=2)
    with torch.no_grad():
        for block in model.h:
            for hc in block.hyper:  # the dynamic parts away from zero so that they count
                for p in (hc.w_alpha, hc.w_beta):
                    p.copy_(torch.randn_like(p) * 0.5)
                hc.s_alpha.fill_(0.3), hc.s_beta.fill_(0.2)
    ins, outs, x0 = _trace(model, _idx())
    assert ins[0].shape == (2, 12, 3, 32) and torch.equal(ins[0], x0[:, :, None].expand(2, 12, 3, 32))
    with torch.no_grad():
        for i, block in enumerate(model.h):
            H = ins[i]
            for j, f in ((1, lambda h: block.attn(h, model.pos)), (2, block.mlp)):
                hc = block.hyper[j - 1]
                normed = H / H.pow(2).mean(-1, keepdim=True).add(torch.finfo(H.dtype).eps).sqrt()
                a = hc.alpha + hc.s_alpha * torch.tanh(normed @ hc.w_alpha)  # (B, T, n, n + 1)
                b = hc.beta + hc.s_beta * torch.tanh(normed @ hc.w_beta)  # (B, T, n)
                h = sum(a[..., s, 0, None] * H[..., s, :] for s in range(3))
                y = f(block.norm(j)(h))
                H = torch.stack([sum(a[..., s, 1 + t, None] * H[..., s, :] for s in range(3)) + b[..., t, None] * y
                                 for t in range(3)], dim=-2)
            torch.testing.assert_close(outs[i], H, rtol=1e-5, atol=1e-5)  # the copies (summed after the last)


STACKS = [{"value_residual": {}}, {"unet": {}, "x0": {}}, {"hyper": {"streams": 2}},
          {"scaled": {"stream": True}, "value_residual": {}, "value_embed": {"tables": 2}, "unet": {}, "x0": {}}]


@pytest.mark.parametrize("residual", STACKS, ids=lambda r: "+".join(r))
def test_checkpointing_gives_the_same_gradients(residual: dict) -> None:
    """The state the options carry across layers (the first layer's values, the skips) survives recomputation."""
    grads = []
    for checkpointing in (False, True):
        model = _model(residual, checkpointing=checkpointing).train()
        idx = _idx()
        model(idx, targets=torch.roll(idx, -1, 1)).backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-6, msg=name)


def test_every_option_reaches_its_weights_with_gradients() -> None:
    model = _model({"scaled": {"stream": True}, "value_residual": {}, "value_embed": {"tables": 2}, "unet": {},
                    "x0": {}}).train()
    idx = _idx()
    model(idx, targets=torch.roll(idx, -1, 1)).backward()
    for name, p in model.named_parameters():
        if name.startswith("residual.") or "branch_scale" in name or "value_mixes" in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("overrides,message", [
    (["residual=parallel", "placement=post"], r"residual=parallel sums the sublayers' branches: placement='post'"),
    (["residual=parallel", "placement=deepnorm"], r"placement='deepnorm' normalises the sum"),
    (["residual=parallel", "block=gau"], r"residual=parallel sums a block's sublayers: block='gau'"),
    (["residual=value_residual", "attention=mla"], r"residual=value_residual with attention=mla"),
    (["residual=value_residual", "block=gau"], r"residual=value_residual mixes attention values"),
    (["residual=unet", "model.n_layer=1"], r"residual=unet .* model.n_layer=1"),
    (["residual=unet", "residual.unet.pairs=[[3,2]]"], r"residual.unet.pairs has \[3, 2\]: .* source < receiver"),
    (["residual=unet", "residual.unet.pairs=[[0,3],[1,3]]"], r"residual.unet.pairs gives layer 3 two skips"),
    (["residual=unet", "residual.unet.gate=tanh"], r"residual.unet.gate"),
    (["residual=scaled", "residual.scaled.stream_init=1.1"], r"stream_init=1.1 .* residual.scaled.stream=true"),
    (["residual=unet", "residual.unet.gate_channels=4096"], r"residual.unet.gate_channels=4096 is more than"),
    (["residual=value_embed", "residual.value_embed.gate_channels=4096"], r"value_embed.gate_channels=4096 is more"),
    (["residual=value_residual", "residual.value_residual.init=2.0"], r"residual\.value_residual\.init=2.0"),
    (["residual=scaled", "residual.scaled.branch_init=-1"], r"residual\.scaled\.branch_init=-1"),
    (["residual=scaled", "residual.scaled.unscaled_mixer=[7]", "model.n_layer=4"],
     r"residual.scaled.unscaled_mixer names layers \[7\], past model.n_layer=4"),
    (["residual=scaled", "residual.scaled.unscaled_mixer=[1]", "mixer.pattern=[attention,none]"],
     r"residual.scaled.unscaled_mixer names layer 1, which has no token mixer"),
    (["+residual.mhc={}"], r"residual='mhc' is not an option; choose one of"),
    (["residual=[hyper,unet]"], r"residual=hyper widens the stream to n copies: it does not stack with residual=unet"),
    (["residual=hyper", "placement=post"], r"residual=hyper adds each sublayer's branch to the copies: placement='pos"),
    (["residual=value_embed", "residual.value_embed.layers=[[0,3],[3,2]]"], r"value_embed.layers names layer \[3\] twice"),
    (["residual=value_embed", "residual.value_embed.tables=5"], r"residual\.value_embed\.tables=5 is more than model.n_layer=4"),
    (["residual=value_embed", "attention=mla"], r"residual=value_embed with attention=mla"),
])
def test_bad_residual_input_is_named_before_training(overrides: list[str], message: str) -> None:
    from lmlab.run.checks import check_config

    with pytest.raises(ValueError, match=message):
        check_config(compose(overrides))


def test_every_option_has_a_yaml_and_composes() -> None:
    from lmlab.run.checks import check_config

    for name in RESIDUALS:
        cfg = compose([f"residual={name}"])
        assert list(cfg.residual) == [name]
        check_config(cfg)


def test_the_monitors_attention_figures_read_no_stale_values() -> None:
    """The monitor's maps run outside the model's forward, on other sequences than the last batch's: the value mixes
    (which read the forward's first-layer values and tokens) are not applied there."""
    from types import SimpleNamespace

    from lmlab.run.monitor import StabilityMonitor

    model = _model({"value_residual": {}, "value_embed": {"tables": 2}})
    with torch.no_grad():
        model(_idx(12))  # the last forward: batch 2, 12 tokens
    monitor = StabilityMonitor()
    monitor._attn_in = {i: (torch.randn(3, 5, 32), None) for i in range(4)}  # 3 sequences of 5
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=1)
    out = monitor._attention_stats(trainer, SimpleNamespace(model=model))
    assert all(0 < out[f"attn/entropy/layer_{i:02d}"] < torch.log(torch.tensor(5.0)) for i in range(4))
