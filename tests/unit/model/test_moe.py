"""ffn=moe: the router's choice and weights against a hand computation; dropless routing equals a per-token loop over
the chosen experts, in outputs and gradients (grouped matmul and padded batched matmul alike), and compiles in one
graph; capacity drops the late assignments and counts them;
the balance loss, router z-loss, the loss-free bias update and the monitor's figures against their formulas; the
parameter counts (total, active, per expert matched as its kind) and active FLOPs; bad input refused by key;
compile=true trains as eager does (slow)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lmlab import build_model, compose
from lmlab.config import GPTConfig
from lmlab.model import moe as moe_mod
from lmlab.model.activation import Activation
from lmlab.model.ffn import FFNS, MLP
from lmlab.model.flops import matmul_params
from lmlab.model.gpt import GPT
from lmlab.model.moe import MoE, balance_loss, bias_update, capacity, figures, route
from lmlab.model.resolve import n_params_estimate, resolve
from lmlab.model.side import objective_part
from lmlab.registry import build

D, H = 16, 12
KINDS = sorted(name for name, cls in FFNS.items() if not getattr(cls, "routed", False))


def _moe_bias(bias: bool, **kw) -> MoE:
    torch.manual_seed(0)
    m = build("ffn", FFNS, {"name": "moe", "n_experts": 4, "top_k": 2, **kw}, D, H, activation={"name": "tanh"},
              bias=bias)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    return m


def test_router_top_k_and_weights_by_hand() -> None:
    z = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.6, -1.0, 0.5, 2.0]])
    idx, w, p = route(z, 2, "softmax", norm_topk=True)
    assert idx.tolist() == [[1, 2], [3, 0]]  # the largest first
    e = [math.exp(v) for v in (1.0, 3.0, 2.0, 0.0)]
    torch.testing.assert_close(w[0], torch.tensor([e[1], e[2]]) / (e[1] + e[2]))
    torch.testing.assert_close(p[0], torch.tensor(e) / sum(e))
    _, w_raw, _ = route(z, 2, "softmax", norm_topk=False)  # Qwen1.5-MoE: the softmax probabilities themselves
    torch.testing.assert_close(w_raw[0], torch.tensor([e[1], e[2]]) / sum(e))
    # sigmoid scores (DeepSeek-V3): chosen by σ(z) + b, weighted by σ(z) only, normalised over the chosen
    b = torch.tensor([0.0, -1.0, 0.0, 0.0])
    idx, w, p = route(z, 2, "sigmoid", norm_topk=True, bias=b)
    s = torch.sigmoid(z[0])
    assert idx[0].tolist() == [2, 0]  # σ(3) − 1 = −0.05 falls below σ(2) and σ(1)
    torch.testing.assert_close(w[0], torch.stack([s[2], s[0]]) / (s[2] + s[0]))
    torch.testing.assert_close(p[0], s / s.sum())


def _expert_by_hand(m: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    w_fc, b_fc = m.c_fc.stack()
    w_proj, b_proj = m.c_proj.stack()
    h = F.linear(x, w_fc[e], None if b_fc is None else b_fc[e])
    h = m.act(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1] if m.glu else m.act(h)
    return F.linear(h, w_proj[e], None if b_proj is None else b_proj[e])


def _per_token(m: MoE, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """The definition: each token alone, its k chosen experts' outputs weighted, plus the shared FFN (gated). With a
    `capacity`, an expert takes the first `capacity` tokens (in token order) that chose it; the later ones skip it."""
    out, taken = [], [0] * m.n_experts
    for t in x.reshape(-1, D):
        idx, w, _ = route((m.router.weight @ t)[None], m.top_k, m.score, m.norm_topk, m.expert_bias)
        y = torch.zeros(D)
        for j in range(m.top_k):
            e = int(idx[0, j])
            taken[e] += 1
            if capacity is None or taken[e] <= capacity:
                y = y + m.routed_scale * w[0, j] * _expert_by_hand(m, e, t)
        if m.shared is not None:
            s = m.shared(t)
            y = y + (torch.sigmoid(m.shared_gate(t)) * s if m.shared_gate is not None else s)
        out.append(y)
    return torch.stack(out).reshape(x.shape)


@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize(("expert", "bias", "extra"), [
    ("mlp", False, {}), ("mlp", True, {"score": "sigmoid"}), ("swiglu", False, {"n_shared": 1, "shared_gate": True}),
    ("glu", True, {"norm_topk": False, "n_shared": 2}), ("geglu", False, {"top_k": 1}),
    ("swiglu", False, {"score": "sigmoid", "n_shared": 1, "routed_scale": 2.5}),  # DeepSeek-V3's
])
def test_dropless_routing_equals_a_per_token_loop(expert: str, bias: bool, extra: dict, grouped: bool,
                                                   monkeypatch) -> None:
    if not grouped:
        monkeypatch.setattr(moe_mod, "_grouped_mm_runs", lambda *a: False)  # the padded batched matmul
    m = _moe_bias(bias, expert=expert, **extra)
    m.expert_bias.normal_(0, 0.3)  # a balancing bias that changes choices: it steers, the weights stay s
    x = torch.randn(3, 5, D)
    for training in (True, False):
        m.train(training)
        torch.testing.assert_close(m(x), _per_token(m, x), rtol=1e-5, atol=1e-5)
    if grouped:
        assert moe_mod._grouped_mm_runs("cpu", torch.float32)  # torch 2.13 runs F.grouped_mm on CPU


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "padded_bmm"])
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_gradients_equal_the_per_token_loop(grouped: bool, capacity_factor: float | None, monkeypatch) -> None:
    """Both paths (F.grouped_mm; the padded batched matmul where it does not run) against the definition, each token
    through its chosen experts one by one: the same gradient for every weight. With a capacity the dropped
    assignments (weight 0 in the sorted batch, or no slot in the padded one) give nothing, as in the loop that skips
    them."""
    if not grouped:
        monkeypatch.setattr(moe_mod, "_grouped_mm_runs", lambda *a: False)
    m = _moe_bias(True, expert="swiglu", n_shared=1, capacity_factor=capacity_factor).train()
    x = torch.randn(4, 6, D)
    m(x).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.named_parameters()}
    m.zero_grad()
    _per_token(m, x, capacity=capacity(24, 2, 4, capacity_factor)).square().sum().backward()
    for n, p in m.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_in_one_graph_as_eager(dtype: torch.dtype) -> None:
    """No graph break (fullgraph): nothing read to the host, no loop. fp32 takes the padded batched matmul under the
    compiler (F.grouped_mm's traced kernel is bf16 only in torch 2.13), bf16 the grouped one."""
    torch._dynamo.reset()
    m = _moe_bias(False, expert="swiglu", capacity_factor=1.0).to(dtype).train()
    x = torch.randn(2, 8, D, dtype=dtype)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(compiled(x), m(x), **tol)


def test_capacity_keeps_the_first_assignments_in_token_order_and_counts_the_drops() -> None:
    """All 8 tokens prefer expert 0, then 1: capacity ceil(0.5 · 8·2 / 4) = 2 keeps tokens 0, 1 on experts 0 and 1;
    the other 12 of 16 assignments are dropped (their tokens get zero)."""
    m = _moe_bias(False, expert="mlp", capacity_factor=0.5)
    assert capacity(8, 2, 4, 0.5) == 2 and capacity(8, 2, 4, None) is None
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0, 0], m.router.weight[1, 0] = 2.0, 1.0
    x = torch.randn(8, D)
    x[:, 0] = x[:, 0].abs() + 1  # feature 0 > 0: expert 0 scores highest, then expert 1
    m.train()
    y = m(x)
    full = _per_token(m, x)
    torch.testing.assert_close(y[:2], full[:2], rtol=1e-5, atol=1e-6)
    assert torch.equal(y[2:], torch.zeros_like(y[2:]))
    stats = figures(m.stats, 4, 2)
    assert stats["dropped"] == 12 / 16
    m.eval()  # evaluation is dropless
    torch.testing.assert_close(m(x), full, rtol=1e-5, atol=1e-6)


def test_balance_loss_z_loss_and_aux_against_their_formulas() -> None:
    counts, probs = torch.tensor([6.0, 2.0, 0.0, 0.0]), torch.tensor([[0.5, 0.3, 0.1, 0.1]] * 4)
    # E Σ f_e P_e with f = counts / (N k), P = mean p: 4 · (0.75·0.5 + 0.25·0.3) = 1.8
    assert float(balance_loss(counts, probs.sum(0), 4, 2)) == pytest.approx(1.8)
    assert float(balance_loss(torch.full((4,), 2.0), torch.full((4,), 1.0), 4, 2)) == pytest.approx(1.0)  # uniform
    m = _moe_bias(False, expert="mlp", balance_loss=0.1, router_z_loss=0.01)
    m.train()
    x = torch.randn(2, 7, D)
    m(x)
    z = x.reshape(-1, D) @ m.router.weight.t()
    idx, _, p = route(z, 2)
    f = torch.bincount(idx.reshape(-1), minlength=4).float() / (14 * 2)
    bal = 4 * (f * p.mean(0)).sum()
    zl = torch.logsumexp(z, -1).square().mean()
    terms = {t.metric: t for t in m.terms}  # its side-channel terms (lmlab.model.side), before their weights
    assert {k: t.weight for k, t in terms.items()} == {"moe_balance_loss": 0.1, "router_z_loss": 0.01}
    torch.testing.assert_close(terms["moe_balance_loss"].value, bal)
    torch.testing.assert_close(terms["router_z_loss"].value, zl)
    torch.testing.assert_close(objective_part(m.terms), 0.1 * bal + 0.01 * zl)
    assert objective_part(m.terms).requires_grad  # it trains the router
    fig = figures(m.stats, 4, 2)
    assert fig["balance_loss"] == pytest.approx(float(bal.detach()), rel=1e-5)
    assert fig["router_z_loss"] == pytest.approx(float(zl.detach()), rel=1e-5)
    assert fig["router_entropy"] == pytest.approx(float(-(p * p.log()).sum(-1).mean().detach()), rel=1e-5)
    c = f * 28
    assert fig["load_max_over_mean"] == pytest.approx(float(c.max() / c.mean()))
    assert fig["load_cv"] == pytest.approx(float(c.std(unbiased=False) / c.mean()), rel=1e-5)
    assert fig["dropped"] == 0.0


def test_gpt_adds_the_aux_losses_to_the_objective_in_training_only() -> None:
    model = build_model(compose(["ffn=moe", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
                                 "ffn.balance_loss=0.01", "ffn.router_z_loss=0.001"]), vocab_size=40)
    idx = torch.randint(0, 40, (2, 16))
    model.train()
    objective, ce, _ = model(idx, idx, parts=True)
    aux = sum(objective_part(b.mlp.terms) for b in model.h)
    torch.testing.assert_close(objective, ce + aux)
    logged = model.figures("train")  # summed over the layers, before the coefficients
    assert sorted(logged) == ["moe_balance_loss", "router_z_loss"] and model.figures("val") == {}
    torch.testing.assert_close(logged["moe_balance_loss"], sum(b.mlp.terms[0].value for b in model.h).detach())
    assert model.side() == {"train": ["moe_balance_loss", "router_z_loss"], "val": [], "figures": ["moe"]}
    model.eval()
    torch.testing.assert_close(model(idx, idx), ce)  # same weights, no aux: validation is the LM loss


def test_bias_update_is_the_sign_rule_and_steers_the_choice() -> None:
    b = bias_update(torch.zeros(4), torch.tensor([5.0, 1.0, 2.0, 0.0]), 0.1)  # mean 2: over, under, equal, under
    torch.testing.assert_close(b, torch.tensor([-0.1, 0.1, 0.0, 0.1]))
    m = _moe_bias(False, expert="mlp", bias_update_rate=0.01)
    m.train()
    x = torch.randn(3, 5, D)
    m(x)
    m(x)  # two forwards (gradient accumulation) before one step: their loads add up
    idx, _, _ = route(x.reshape(-1, D) @ m.router.weight.t(), 2)
    load = 2 * torch.bincount(idx.reshape(-1), minlength=4).float()
    m.update_bias(reduce=lambda t: 3 * t)  # "3 ranks" with this load each: the sign is the same
    torch.testing.assert_close(m.expert_bias, 0.01 * torch.sign(load.mean() - load))
    assert "expert_bias" in m.state_dict()  # saved in the checkpoint
    m.update_bias()  # no forward since: nothing moves
    torch.testing.assert_close(m.expert_bias, 0.01 * torch.sign(load.mean() - load))
    with torch.no_grad():
        m.expert_bias.copy_(torch.tensor([10.0, 10.0, 0.0, 0.0]))
    m.eval()
    ys, ref = m(x), []
    for t in x.reshape(-1, D):
        w = torch.softmax(m.router.weight @ t, -1)
        ref.append((w[0] * _expert_by_hand(m, 0, t) + w[1] * _expert_by_hand(m, 1, t)) / (w[0] + w[1]))
    torch.testing.assert_close(ys, torch.stack(ref).reshape(x.shape), rtol=1e-5, atol=1e-6)  # b chose, σ weighed


@pytest.mark.parametrize("expert", KINDS)
def test_each_expert_is_sized_as_a_dense_ffn_of_its_kind_and_counted(expert: str) -> None:
    for bias in (False, True):
        for ffn in ({"expert": expert}, {"expert": expert, "n_shared": 2, "shared_gate": True, "n_experts": 6,
                                         "top_k": 3}):
            cfg = resolve(GPTConfig(vocab_size=50, d_model=64, n_head=4, n_layer=2, bias=bias,
                                    ffn={"name": "moe", "hidden_mult": 4, "multiple_of": 64, **ffn}))
            dense = resolve(GPTConfig(vocab_size=50, d_model=64, n_head=4, n_layer=2, bias=bias,
                                      ffn={"name": expert, "hidden_mult": 4, "multiple_of": 64}))
            assert cfg.ffn_hidden == dense.ffn_hidden
            with torch.device("meta"):
                model, dense_model = GPT(cfg), GPT(dense)
            E, k, shared = ffn.get("n_experts", 8), ffn.get("top_k", 2), ffn.get("n_shared", 0)
            per_expert = FFNS[expert].n_params(64, cfg.ffn_hidden, bias)
            shared_n = FFNS[expert].n_params(64, shared * cfg.ffn_hidden, bias) if shared else 0
            layer = 64 * E + E * per_expert + shared_n + 64 * ffn.get("shared_gate", False)
            other = dense_model.num_params() - 2 * per_expert  # the dense model less its two FFNs
            assert model.num_params() == other + 2 * layer
            assert model.num_params(active=True) == other + 2 * (layer - (E - k) * per_expert)
            assert n_params_estimate(cfg) <= model.num_params() <= 1.01 * n_params_estimate(cfg)
            # active FLOPs: the experts' matmul weights count k/E; the router, the shared FFN and its gate fully
            if not bias:
                assert matmul_params(model) == matmul_params(dense_model) + 2 * (
                    64 * E + (k - 1) * per_expert + shared_n + 64 * ffn.get("shared_gate", False))


def test_bad_input_is_refused_before_training_naming_the_key() -> None:
    from lmlab.run.checks import check_config

    for overrides, message in (
        (["ffn.top_k=9"], r"ffn\.top_k=9 > ffn\.n_experts=8"),
        (["ffn.capacity_factor=0"], r"ffn\.capacity_factor=0 must be a float > 0 or null"),
        (["ffn.capacity_factor=-1.5"], r"ffn\.capacity_factor=-1\.5 must be"),
        (["ffn.expert=moe"], r"ffn\.expert='moe' is not an expert kind; choose one of \['geglu', 'glu', 'mlp'"),
        (["ffn.score=relu"], r"ffn\.score='relu' must be one of \['softmax', 'sigmoid'\]"),
        (["ffn.shared_gate=true"], r"ffn\.shared_gate=true .* needs ffn\.n_shared >= 1"),
        (["ffn.n_experts=0"], r"ffn\.n_experts=0 must be an integer >= 1"),
        (["ffn.routed_scale=0"], r"ffn\.routed_scale=0 must be a float > 0"),
    ):
        with pytest.raises(ValueError, match=message):
            check_config(compose(["ffn=moe", *overrides]))


def test_generation_through_the_kv_cache_gives_the_full_forward() -> None:
    from lmlab.model.attention.cache import KVCache

    model = build_model(compose(["ffn=moe", "model.n_layer=2", "model.d_model=32", "model.n_head=2",
                                 "ffn.capacity_factor=1.0", "ffn.n_shared=1"]), vocab_size=40).eval()
    idx = torch.randint(0, 40, (2, 12))
    full = model(idx)
    cache = KVCache(2)
    steps = [model(idx[:, :5], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(5, 12)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=1e-5, atol=1e-5)


def test_causal_in_training_when_dropless() -> None:
    model = build_model(compose(["ffn=moe", "model.n_layer=2", "model.d_model=32", "model.n_head=2"]),
                        vocab_size=40).train()
    idx = torch.randint(0, 40, (1, 16))
    other = idx.clone()
    other[:, 10:] = (other[:, 10:] + 1) % 40
    torch.testing.assert_close(model(idx)[:, :10], model(other)[:, :10])
    assert Activation({"name": "silu"}).name == model.h[0].mlp.act.name  # ffn=moe's experts are SwiGLU
    assert isinstance(FFNS["mlp"](D, H, activation={"name": "gelu"}), MLP)


def test_the_expert_load_heat_map_is_drawn_from_metrics(tmp_path) -> None:
    from lmlab.record.plots import main, plot_expert_load

    runs = {"a": {f"moe/load_max_over_mean/layer_0{i}": [(s, 1 + i + s / 10) for s in range(0, 50, 10)]
                  for i in range(3)}, "dense": {"train/loss": [(0, 3.0), (1, 2.0)]}}
    assert plot_expert_load(runs, tmp_path / "load.png").stat().st_size > 0
    assert plot_expert_load({"dense": runs["dense"]}, tmp_path / "none.png") is None
    run = tmp_path / "sweep" / "ffn=moe"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("step,moe/load_cv/layer_00\n0,0.5\n10,0.25\n")
    main(["moe", str(tmp_path / "sweep"), "--figure", "load_cv", "--out", str(tmp_path / "cv.png")])
    assert (tmp_path / "cv.png").stat().st_size > 0
    with pytest.raises(SystemExit, match="no run under"):
        main(["moe", str(tmp_path / "sweep"), "--out", str(tmp_path / "x.png")])


def test_compare_shows_active_parameters_and_the_expert_load(tmp_path) -> None:
    """`eval.py compare=` over dense and MoE runs: an n_active_params column (the rebuilt model's when the summary has
    none) beside n_params, and plots/expert_load.png from the MoE runs' metrics."""
    import csv
    import json

    from lmlab.analysis.compare import compare

    sweep = tmp_path / "sweep"
    expected = {}
    for name, ffn in (("swiglu", {"name": "swiglu"}), ("moe", {"name": "moe", "n_experts": 4, "top_k": 1})):
        cfg = resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=64, n_head=4, ffn={**ffn, "hidden_mult": 4,
                                                                                    "multiple_of": 64}))
        with torch.device("meta"):
            model = GPT(cfg)
        expected[name] = (model.num_params(), model.num_params(active=True))
        run = sweep / f"ffn={name}"
        run.mkdir(parents=True)
        (run / "summary.json").write_text(json.dumps({
            "status": "completed", "steps": 20, "overrides": [f"ffn={name}"], "final_val_loss": 2.0,
            "best_val_loss": 2.0, "n_params": expected[name][0], "model": cfg.to_dict()}))
        (run / "metrics.csv").write_text("step,train/loss,moe/load_max_over_mean/layer_00\n0,3.0,2.0\n10,2.5,1.5\n")
    compare(sweep)
    with open(sweep / "compare.csv") as f:
        rows = {r["ffn"]: r for r in csv.DictReader(f)}
    for name, (total, active) in expected.items():
        assert int(rows[name]["n_params"]) == total and int(rows[name]["n_active_params"]) == active
    assert expected["swiglu"][0] == expected["swiglu"][1] and expected["moe"][1] < expected["moe"][0] / 2
    assert "| n_params | n_active_params |" in (sweep / "compare.md").read_text()
    assert (sweep / "plots" / "expert_load.png").stat().st_size > 0


def test_the_grouped_mm_probe_answers_the_same_under_no_grad() -> None:
    """A first routing call under no_grad or inference mode (eval, generation) must not cache 'no grouped_mm' for the
    training that follows."""
    moe_mod._grouped_mm_runs.cache_clear()
    with torch.inference_mode():
        assert moe_mod._grouped_mm_runs("cpu", torch.float32)
    moe_mod._grouped_mm_runs.cache_clear()
    with torch.no_grad():
        assert moe_mod._grouped_mm_runs("cpu", torch.float32)
