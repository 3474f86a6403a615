"""Optimizers and schedules: weight-decay groups (matrices of Linear layers only), the zero-gradient step that
every optimizer must turn into exactly p·(1 − lr·wd) on the decay group, Lion's sign update, and every schedule's
warmup and end values."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from omegaconf import OmegaConf

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.gpt import GPT
from lmlab.model.norm import NORMS
from lmlab.optim import OPTIMIZERS, SCHEDULES, param_groups
from lmlab.registry import build
from tests.runs import ROOT

CONF = ROOT / "conf"


def _model(**kw) -> GPT:
    base = dict(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16)
    return GPT(GPTConfig(**{**base, **kw}))


def _yaml(group: str, name: str) -> dict:
    """The group's option as a run composes it (its YAML and the group's shared keys, conf/optim_base)."""
    return OmegaConf.to_container(compose([f"{group}={name}"])[group], resolve=True)


# ---- weight-decay groups ------------------------------------------------------------------------------------


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("norm", sorted(n for n in NORMS if not hasattr(NORMS[n], "attach")))  # ngpt: test_ngpt.py
def test_param_groups_decay_only_linear_matrices(norm: str, tie: bool) -> None:
    model = _model(norm={"name": norm}, bias=True, tie_embeddings=tie, position={"name": "learned"},
                   attention={"name": "mha", "qk_norm": True})
    decay, rest = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    expected_decay = linear_weights - embeddings  # a tied head is the embedding: not decayed
    assert {id(p) for p in decay["params"]} == expected_decay
    everything = {id(p) for p in model.parameters()}
    assert {id(p) for p in rest["params"]} == everything - expected_decay
    assert len(decay["params"]) + len(rest["params"]) == len(everything)  # each parameter exactly once
    names = {id(p): n for n, p in model.named_parameters()}
    for p in rest["params"]:
        n = names[id(p)]
        assert n.endswith("bias") or "ln_" in n or n.startswith(("wte", "pos.wpe")) or "_norm" in n, n
    assert id(model.wte.weight) not in {id(p) for p in decay["params"]}
    assert (id(model.lm_head.weight) in {id(p) for p in decay["params"]}) == (not tie)
    # every matrix in the decay group is 2-D, and every 2-D Linear weight is in it
    assert all(p.dim() == 2 for p in decay["params"])


def test_param_groups_skip_frozen() -> None:
    model = _model()
    model.h[0].attn.c_attn.weight.requires_grad_(False)
    decay, rest = param_groups(model, 0.1)
    assert id(model.h[0].attn.c_attn.weight) not in {id(p) for p in decay["params"] + rest["params"]}


# ---- optimizers ---------------------------------------------------------------------------------------------


def _optimizer(name: str, groups: list[dict]):
    from lmlab.run.lit import optimizer_spec

    return build("optim", OPTIMIZERS, optimizer_spec(_yaml("optim", name)), groups)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_zero_gradient_step_is_pure_decoupled_decay(name: str) -> None:
    """With zero gradients, one step shrinks the decay group by exactly (1 − lr·wd) and leaves the rest alone; an
    option whose decay sits inside a trust ratio (LAMB: r = wd·θ, ratio ‖θ‖/‖wd·θ‖ = 1/wd) by exactly (1 − lr)."""
    torch.manual_seed(0)
    w, b = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))
    w0, b0 = w.detach().clone(), b.detach().clone()
    wd = 0.5
    opt = _optimizer(name, [{"params": [w], "weight_decay": wd}, {"params": [b], "weight_decay": 0.0}])
    lr = opt.param_groups[0]["lr"]
    assert lr == _yaml("optim", name)["lr"]
    w.grad, b.grad = torch.zeros_like(w), torch.zeros_like(b)
    opt.step()
    factor = 1 - lr if getattr(OPTIMIZERS[name], "trust_ratio", False) else 1 - lr * wd
    torch.testing.assert_close(w.detach(), w0 * factor, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(b.detach(), b0, rtol=0, atol=0)


@pytest.mark.parametrize("fused", [None, True, False])
def test_adamw_fused_is_auto_on_cpu_and_matches_the_textbook_step(fused: bool | None) -> None:
    """fused=None takes torch's fused kernel for CPU parameters; every implementation gives AdamW's update:
    p ← p·(1 − lr·wd) − lr·m̂/(√v̂ + eps), m̂ = g, v̂ = g² after one step (bias-corrected)."""
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(6, 5))
    w0, g = w.detach().clone(), torch.randn(6, 5)
    opt = OPTIMIZERS["adamw"]([{"params": [w], "weight_decay": 0.1}], lr=0.01, fused=fused)
    assert bool(opt.defaults["fused"]) == (fused is not False)
    w.grad = g.clone()
    opt.step()
    expected = w0 * (1 - 0.01 * 0.1) - 0.01 * g / (g.abs() + 1e-8)
    torch.testing.assert_close(w.detach(), expected, rtol=1e-5, atol=1e-6)


def test_adamw_fused_auto_leaves_meta_parameters_unfused() -> None:
    """The fused kernel exists for CPU/CUDA tensors only: anything else keeps torch's default loop."""
    w = torch.nn.Parameter(torch.empty(3, 3, device="meta"))
    assert not OPTIMIZERS["adamw"]([{"params": [w], "weight_decay": 0.0}]).defaults["fused"]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_step_descends(name: str) -> None:
    """A few steps on f(p) = ½‖p − 3‖² from p = 0 reduce f (no weight decay)."""
    p = torch.nn.Parameter(torch.zeros(5))
    opt = _optimizer(name, [{"params": [p], "weight_decay": 0.0}])
    losses = []
    for _ in range(3):
        opt.zero_grad()
        loss = 0.5 * (p - 3).pow(2).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    final = 0.5 * (p.detach() - 3).pow(2).sum().item()
    assert final < losses[0]


def test_lion_first_step_is_minus_lr_sign_grad() -> None:
    p = torch.nn.Parameter(torch.randn(6, 4))
    p0 = p.detach().clone()
    g = torch.randn(6, 4)
    opt = OPTIMIZERS["lion"]([{"params": [p], "weight_decay": 0.0}], lr=0.01)
    p.grad = g.clone()
    opt.step()
    torch.testing.assert_close(p.detach() - p0, -0.01 * torch.sign(g), rtol=0, atol=1e-7)


def test_lion_second_step_uses_interpolated_momentum() -> None:
    """update_2 = sign(β1·m + (1 − β1)·g2) with m = (1 − β2)·g1 after the first step."""
    p = torch.nn.Parameter(torch.zeros(200))
    b1, b2, lr = 0.9, 0.99, 0.1
    opt = OPTIMIZERS["lion"]([{"params": [p], "weight_decay": 0.0}], lr=lr, betas=(b1, b2))
    g1, g2 = torch.randn(200), torch.randn(200)
    p.grad = g1.clone()
    opt.step()
    after1 = p.detach().clone()
    p.grad = g2.clone()
    opt.step()
    expected = -lr * torch.sign(b1 * (1 - b2) * g1 + (1 - b1) * g2)
    torch.testing.assert_close(p.detach() - after1, expected, rtol=0, atol=1e-7)
    assert not torch.equal(torch.sign(expected), -torch.sign(g2))  # momentum matters somewhere


def test_lion_decoupled_weight_decay() -> None:
    p = torch.nn.Parameter(torch.randn(8))
    p0, g = p.detach().clone(), torch.randn(8)
    opt = OPTIMIZERS["lion"]([{"params": [p], "weight_decay": 0.1}], lr=0.01)
    p.grad = g
    opt.step()
    torch.testing.assert_close(p.detach(), p0 * (1 - 0.01 * 0.1) - 0.01 * torch.sign(g), rtol=0, atol=1e-7)


# ---- schedules ----------------------------------------------------------------------------------------------


# The multiplier at max_steps of each schedule: a key of its YAML, a number, or a function of its YAML's values
END_VALUE = {"cosine": "min_lr_ratio", "linear": "min_lr_ratio", "wsd": "min_lr_ratio", "constant": 1.0,
             "inverse_sqrt": lambda p, max_steps: math.sqrt(p["warmup_steps"] / (max_steps + 1))}  # no end: √(w/n)


@pytest.mark.parametrize("warmup", [1, 10, 100])
@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_warmup_is_linear_from_one_over_warmup(name: str, warmup: int) -> None:
    fn = SCHEDULES[name]
    values = [fn(s, 1000, warmup_steps=warmup) for s in range(warmup)]
    assert values == pytest.approx([(s + 1) / warmup for s in range(warmup)], rel=1e-12)
    assert values[0] == pytest.approx(1 / warmup) and values[-1] == pytest.approx(1.0)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_no_warmup_starts_at_full_lr(name: str) -> None:
    assert SCHEDULES[name](0, 1000, warmup_steps=0) == pytest.approx(1.0)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_yaml_schedule_values(name: str) -> None:
    spec = _yaml("schedule", name)
    params = {k: v for k, v in spec.items() if k != "name"}
    fn, warmup, max_steps = SCHEDULES[name], spec["warmup_steps"], 1000
    assert fn(0, max_steps, **params) == pytest.approx(1 / warmup)
    assert fn(warmup - 1, max_steps, **params) == pytest.approx(1.0)  # the warmup's last step: the full rate
    # right after it, still the full rate, or (inverse_sqrt, Vaswani's √(W/n)) one step down from it
    assert math.sqrt(warmup / (warmup + 1)) - 1e-12 <= fn(warmup, max_steps, **params) <= 1.0 + 1e-12
    values = [fn(s, max_steps, **params) for s in range(max_steps + 1)]
    assert all(0 <= v <= 1 + 1e-12 for v in values)
    assert all(a >= b - 1e-12 for a, b in zip(values[warmup:], values[warmup + 1:]))  # never rises after warmup
    assert set(END_VALUE) == set(SCHEDULES)  # a new schedule states where it ends
    end = END_VALUE[name]
    expected = params[end] if isinstance(end, str) else end(params, max_steps) if callable(end) else end
    assert values[-1] == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("min_ratio", [0.0, 0.1])
def test_cosine_shape(min_ratio: float) -> None:
    cos = SCHEDULES["cosine"]
    kw = dict(warmup_steps=10, min_lr_ratio=min_ratio)
    assert cos(10, 110, **kw) == pytest.approx(1.0)
    assert cos(60, 110, **kw) == pytest.approx(min_ratio + (1 - min_ratio) * 0.5)  # half way
    assert cos(35, 110, **kw) == pytest.approx(min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi / 4)))
    assert cos(110, 110, **kw) == pytest.approx(min_ratio)
    assert cos(500, 110, **kw) == pytest.approx(min_ratio)  # past the end it stays at the floor


def test_linear_shape() -> None:
    lin = SCHEDULES["linear"]
    kw = dict(warmup_steps=10, min_lr_ratio=0.2)
    assert lin(10, 110, **kw) == pytest.approx(1.0)
    assert lin(60, 110, **kw) == pytest.approx(0.6)
    assert lin(110, 110, **kw) == pytest.approx(0.2)
    assert lin(200, 110, **kw) == pytest.approx(0.2)


def test_wsd_shape() -> None:
    wsd = SCHEDULES["wsd"]
    kw = dict(warmup_steps=10, decay_frac=0.2, min_lr_ratio=0.0)
    assert [wsd(s, 100, **kw) for s in (10, 50, 79, 80)] == pytest.approx([1.0, 1.0, 1.0, 1.0])  # stable
    assert wsd(90, 100, **kw) == pytest.approx(0.5)  # linear cool-down over the last 20 steps
    assert wsd(95, 100, **kw) == pytest.approx(0.25)
    assert wsd(100, 100, **kw) == pytest.approx(0.0)
    assert wsd(90, 100, warmup_steps=10, decay_frac=0.2, min_lr_ratio=0.1) == pytest.approx(0.55)


def test_constant_after_warmup() -> None:
    assert [SCHEDULES["constant"](s, 100, warmup_steps=4) for s in (3, 4, 50, 100)] == [1.0, 1.0, 1.0, 1.0]


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_schedule_drives_lambda_lr(name: str) -> None:
    """As LitGPT wires it: LambdaLR(step -> fn(step, max_steps, **params)) sets lr = base · multiplier."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.5)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: SCHEDULES[name](s, 20, warmup_steps=4))
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.125, 0.25, 0.375, 0.5])


# ---- AdamW with learning-rate-independent weight decay -------------------------------------------------------


def test_adamw_independent_wd_decays_by_wd_times_schedule_not_lr() -> None:
    """independent_wd: zero-gradient steps shrink by (1 − s_t·wd), s_t the schedule's multiplier, whatever lr is;
    torch's AdamW (independent_wd=false) shrinks by (1 − lr·s_t·wd)."""
    for independent, lr in ((True, 0.01), (True, 0.3), (False, 0.01)):
        w = torch.nn.Parameter(torch.full((2, 2), 2.0))
        opt = OPTIMIZERS["adamw"]([{"params": [w], "weight_decay": 0.1}], lr=lr, independent_wd=independent)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: [1.0, 0.5, 0.5][s])  # a schedule: 1, then 0.5
        for _ in range(2):
            w.grad = torch.zeros_like(w)
            opt.step()
            sched.step()
        expected = 2.0 * (1 - 0.1) * (1 - 0.05) if independent else 2.0 * (1 - lr * 0.1) * (1 - lr * 0.05)
        torch.testing.assert_close(w.detach(), torch.full((2, 2), expected), rtol=1e-6, atol=0)
    # independent: 2·0.9·0.95 = 1.71 for both lr = 0.01 and lr = 0.3; coupled at lr 0.01: 2·0.999·0.9995
    assert 2.0 * (1 - 0.1) * (1 - 0.05) == pytest.approx(1.71)


def test_adamw_independent_wd_keeps_adams_step() -> None:
    """The gradient part is AdamW's: first step −lr·sign(g) (bias-corrected), plus the independent decay."""
    w = torch.nn.Parameter(torch.tensor([[1.0, -2.0], [3.0, 0.5]]))
    g = torch.tensor([[0.3, -0.1], [0.0, 2.0]])
    opt = OPTIMIZERS["adamw"]([{"params": [w], "weight_decay": 0.01}], lr=0.1, eps=1e-12, independent_wd=True)
    w.grad = g.clone()
    opt.step()
    expected = torch.tensor([[1.0 * 0.99 - 0.1, -2.0 * 0.99 + 0.1], [3.0 * 0.99, 0.5 * 0.99 - 0.1]])
    torch.testing.assert_close(w.detach(), expected, rtol=1e-6, atol=1e-6)


# ---- Amos ---------------------------------------------------------------------------------------------------


def test_amos_scale_rule() -> None:
    from lmlab.optim.amos import Amos

    assert Amos.scale(torch.empty(6, 16)) == pytest.approx(0.25)  # 1/sqrt(fan_in), fan_in = in_features = 16
    assert Amos.scale(torch.empty(3, 4, 9)) == pytest.approx(1 / 3)  # last dim is the input dim
    assert Amos.scale(torch.empty(7), vector_scale=0.5) == 0.5  # biases, norm gains: a fixed scale
    assert Amos.scale(torch.empty(()), vector_scale=0.2) == 0.2


def _amos_by_hand(theta: list[float], grads: list[list[float]], eta: float, xi: float, beta: float, c: float,
                  d: float, wd: float = 0.0, mu: float = 0.0, eps: float = 2.0 ** -125) -> list[float]:
    """Algorithm 1 of Tian & Parikh (2022) as the authors' jestimator `amos.py` computes it, for entries that share
    one slot (v, b), number by number: v_t = β·v + (1−β)·mean(g²); v̂ = max(v_t, ε)/(1−β^t); c_t = (1 + c·√ξ·b)^(−½);
    d_t = 1/(1 + d·√(ξ·η̃)·b); γ_t = c_t·ξ²·mean(g²)/v̂; u = −d_t·(ξ·η̃·g/√v̂ + (½·γ_t + ξ·wd)·θ);
    m = μ·m + (1−μ)·u (μ > 0, else m = u); θ ← θ + m; b ← b + γ_t·(1 + b)."""
    v = b = 0.0
    m = [0.0] * len(theta)
    for t, g in enumerate(grads, start=1):
        m2 = sum(x * x for x in g) / len(g)
        v = beta * v + (1 - beta) * m2
        v_hat = max(v, eps) / (1 - beta ** t)
        c_t = (1 + c * math.sqrt(xi) * b) ** -0.5
        d_t = 1 / (1 + d * math.sqrt(xi * eta) * b)
        gamma = c_t * xi ** 2 * m2 / v_hat
        u = [-d_t * (xi * eta * x / math.sqrt(v_hat) + (0.5 * gamma + xi * wd) * th) for th, x in zip(theta, g)]
        m = [mu * mi + (1 - mu) * ui for mi, ui in zip(m, u)] if mu > 0 else u
        theta = [th + mi for th, mi in zip(theta, m)]
        b = b + gamma * (1 + b)
    return theta


AMOS_W0 = [[1.0, -2.0], [0.5, 4.0]]  # (out 2, in 2): η̃ = 1/√2
AMOS_GW = [[[2.0, 0.0], [0.0, 0.0]], [[0.0, 1.0], [1.0, 0.0]]]  # steps 1 and 2 (row 1 has no gradient at step 1)
AMOS_B0, AMOS_GB = [0.2, -0.4], [[0.4, -0.2], [0.0, 0.6]]


def _amos_run(slots: str, wd: float = 0.0, mu: float = 0.0, xi: float = 0.5) -> tuple[torch.Tensor, torch.Tensor, dict]:
    W = torch.nn.Parameter(torch.tensor(AMOS_W0))
    bias = torch.nn.Parameter(torch.tensor(AMOS_B0))  # η̃ = vector_scale = 0.5
    opt = OPTIMIZERS["amos"]([{"params": [W], "weight_decay": wd}, {"params": [bias], "weight_decay": 0.0}], lr=xi,
                             beta=0.9, c=0.25, d=0.25, vector_scale=0.5, slots=slots, momentum=mu)
    for step in range(2):
        W.grad, bias.grad = torch.tensor(AMOS_GW[step]), torch.tensor(AMOS_GB[step])
        opt.step()
    return W.detach(), bias.detach(), opt.state[W]


@pytest.mark.parametrize("slots", ["row", "tensor", "element"])
def test_amos_two_steps_match_the_papers_equations_by_hand(slots: str) -> None:
    """Two steps with a large ξ (so the decays show), each slot of v and b computed apart: per matrix row (the
    authors' recipe, default), per tensor, per entry. A bias is one slot under `row`."""
    hand = functools.partial(_amos_by_hand, xi=0.5, beta=0.9, c=0.25, d=0.25)
    # step 1 by hand, one slot per tensor: m2 = 1, v = 0.1, v̂ = 1, c1 = d1 = 1, γ1 = 0.25: θ − (0.5/√2·g + 0.125·θ)
    step1 = [1.0 - (0.5 / math.sqrt(2) * 2.0 + 0.125), -2.0 * 0.875, 0.5 * 0.875, 4.0 * 0.875]
    assert hand([1.0, -2.0, 0.5, 4.0], [[2.0, 0.0, 0.0, 0.0]], 1 / math.sqrt(2)) == pytest.approx(step1)
    W, bias, state = _amos_run(slots)
    flat = [[x for row in g for x in row] for g in AMOS_GW]
    if slots == "row":  # row 0 and row 1 apart; row 1's v stays 0 at step 1 (ε keeps v̂ > 0, its update is 0)
        expected_W = [hand(AMOS_W0[r], [g[r] for g in AMOS_GW], 1 / math.sqrt(2)) for r in range(2)]
        expected_b = hand(AMOS_B0, AMOS_GB, 0.5)
        assert state["v"].shape == (2, 1)
    elif slots == "tensor":
        expected_W = hand([x for row in AMOS_W0 for x in row], flat, 1 / math.sqrt(2))
        expected_b = hand(AMOS_B0, AMOS_GB, 0.5)
        assert state["v"].shape == ()
    else:
        expected_W = [hand([th], [[g[i]] for g in flat], 1 / math.sqrt(2))[0]
                      for i, th in enumerate(x for row in AMOS_W0 for x in row)]
        expected_b = [hand([th], [[g[i]] for g in AMOS_GB], 0.5)[0] for i, th in enumerate(AMOS_B0)]
        assert state["v"].shape == (2, 2)
    torch.testing.assert_close(W.flatten(), torch.tensor(expected_W).flatten(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(bias, torch.tensor(expected_b), rtol=1e-5, atol=1e-6)
    assert bool((state["b"] > 0.25).any())  # the decay accumulator grew past γ1 = 0.25: later decay factors < 1


def test_amos_weight_decay_and_momentum() -> None:
    """The group's weight_decay adds ξ·wd·θ inside d_t·(...) (lmlab's lr·wd; the reference's extra_l2 = ξ·wd), and
    momentum μ keeps a moving average of the updates (the paper's optional momentum)."""
    hand = functools.partial(_amos_by_hand, xi=0.5, beta=0.9, c=0.25, d=0.25)
    for wd, mu in ((0.1, 0.0), (0.0, 0.9), (0.1, 0.9)):
        W, _, _ = _amos_run("row", wd=wd, mu=mu)
        expected = [hand(AMOS_W0[r], [g[r] for g in AMOS_GW], 1 / math.sqrt(2), wd=wd, mu=mu) for r in range(2)]
        torch.testing.assert_close(W, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    plain = [hand(AMOS_W0[r], [g[r] for g in AMOS_GW], 1 / math.sqrt(2)) for r in range(2)]
    assert not torch.allclose(_amos_run("row", wd=0.1)[0], torch.tensor(plain), atol=1e-4)  # the decay shows
    assert not torch.allclose(_amos_run("row", mu=0.9)[0], torch.tensor(plain), atol=1e-4)  # so does momentum


def test_amos_trains_a_quadratic() -> None:
    """f(W) = ½‖W − A‖² on a 4x8 matrix from 0: 300 Amos steps at the YAML's settings cut f by 90%+."""
    torch.manual_seed(0)
    A = torch.randn(4, 8) * 0.3
    W = torch.nn.Parameter(torch.zeros(4, 8))
    spec = {**_yaml("optim", "amos"), "lr": 0.1}
    from lmlab.run.lit import optimizer_spec

    opt = build("optim", OPTIMIZERS, optimizer_spec(spec), [{"params": [W], "weight_decay": 0.0}])
    losses = []
    for _ in range(300):
        opt.zero_grad()
        loss = 0.5 * (W - A).pow(2).sum()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]
    assert all(math.isfinite(x) for x in losses)


# ---- Adafactor ----------------------------------------------------------------------------------------------


def test_adafactor_builds_steps_and_factors_its_state() -> None:
    """torch's Adafactor: a matrix keeps a row and a column second moment (rows + cols numbers, not rows·cols)."""
    torch.manual_seed(0)
    W, bias = torch.nn.Parameter(torch.randn(16, 8)), torch.nn.Parameter(torch.zeros(16))
    opt = _optimizer("adafactor", [{"params": [W], "weight_decay": 0.0}, {"params": [bias], "weight_decay": 0.0}])
    assert isinstance(opt, torch.optim.Adafactor)
    W0 = W.detach().clone()
    loss = (W.sum(1) + bias).pow(2).sum()
    loss.backward()
    opt.step()
    assert not torch.equal(W.detach(), W0) and torch.isfinite(W).all()
    assert opt.state[W]["row_var"].numel() + opt.state[W]["col_var"].numel() == 16 + 8
    after = (W.sum(1) + bias).pow(2).sum().item()
    assert after < loss.item()


# ---- inverse square root ------------------------------------------------------------------------------------


def test_inverse_sqrt_values() -> None:
    inv = SCHEDULES["inverse_sqrt"]
    # Vaswani et al.: d^-0.5 · min(n^-0.5, n · W^-1.5) at the 1-based step n = step + 1, over its peak W^-0.5
    vaswani = lambda n, w: min(n ** -0.5, n * w ** -1.5) / w ** -0.5  # noqa: E731
    assert [inv(s, 100, warmup_steps=4) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert inv(4, 100, warmup_steps=4) == pytest.approx(math.sqrt(4 / 5))  # one step past the peak: √(W/(W+1))
    assert inv(10, 100, warmup_steps=10) == pytest.approx(0.953463, abs=1e-6)  # not 1.0 (the 0.047 at W=10)
    assert inv(15, 100, warmup_steps=4) == pytest.approx(0.5)  # n = 16 = 4W: ½
    assert inv(399, 100, warmup_steps=4) == pytest.approx(0.1)  # no end: it keeps falling past max_steps
    for w in (1, 4, 10, 100):
        assert [inv(s, 1000, warmup_steps=w) for s in range(500)] == pytest.approx([vaswani(s + 1, w)
                                                                                    for s in range(500)])
    # warmup 0: 1/√n, the full rate at the first step (√(0/n) would be 0 everywhere)
    assert [inv(s, 100, warmup_steps=0) for s in (0, 3, 99)] == pytest.approx([1.0, 0.5, 0.1])
