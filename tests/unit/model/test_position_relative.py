"""position=t5, xpos and fire against their papers' formulas, numbers written out by hand: T5's causal buckets (and
transformers' own bucket function) and its bias = table[bucket]; xPos's scaled rotation, q·k depending on n − m only,
scale 1 at n = m; FIRE's bias = f_θ(ψ(i − j) / ψ(max(L, i))). For each, in a full model: causality, the KV cache giving
the full forward's logits with sharpened position weights, forward and backward from the YAMLs, and the refusals
(export=hf, per_document, rope_scaling, lengths xPos's scale cannot hold)."""

from __future__ import annotations

import math

import pytest
import torch

from lmlab import build_model, compose
from lmlab.config import GPTConfig
from lmlab.interop.hf_config import NotRepresentable, family
from lmlab.model.attention.cache import KVCache
from lmlab.model.gpt import GPT, validate
from lmlab.model.position import POSITIONS, t5_bucket
from lmlab.model.resolve import resolve
from lmlab.registry import build

NEW = ("t5", "xpos", "fire")
NH, HS = 2, 4
TOL = dict(rtol=1e-5, atol=1e-5)


def _pos(name: str, head_dim: int = HS, **params):
    return build("position", POSITIONS, {"name": name, **params}, NH * head_dim, head_dim, NH, 64, 64, {"name": "none"})


# ---- T5 -------------------------------------------------------------------------------------------------------------

# n = i − j -> bucket, num_buckets=32, max_distance=128: n below 16 is its own bucket, then 16 + ⌊ln(n/16)/ln(8)·16⌋:
# 20: ln 1.25 / ln 8 · 16 = 1.72 -> 17; 32: 16/3 = 5.33 -> 21; 64: 32/3 = 10.67 -> 26; 127: 15.94 -> 31; 128 and on: 31
T5_BUCKETS = {**{n: n for n in range(16)}, 16: 16, 20: 17, 32: 21, 64: 26, 127: 31, 128: 31, 500: 31}
# num_buckets=8, max_distance=20: E = 4, then 4 + ⌊ln(n/4)/ln 5 · 4⌋: 5: 0.55 -> 4; 6: 1.008 -> 5; 8: 1.72 -> 5;
# 9: 2.02 -> 6; 13: 2.93 -> 6; 14: 3.11 -> 7; 20 and on: 7
SMALL_BUCKETS = [0, 1, 2, 3, 4, 4, 5, 5, 5, 6, 6, 6, 6, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]


def test_t5_buckets_by_hand() -> None:
    n = torch.tensor(list(T5_BUCKETS))
    assert t5_bucket(n, 32, 128).tolist() == list(T5_BUCKETS.values())
    assert t5_bucket(torch.arange(24), 8, 20).tolist() == SMALL_BUCKETS
    assert t5_bucket(torch.tensor([-1, -50]), 32, 128).tolist() == [0, 0]  # the future (masked anyway)


def test_t5_buckets_are_transformers_unidirectional_ones() -> None:
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    n = torch.arange(0, 1000)
    theirs = t5.T5Attention._relative_position_bucket(-n, bidirectional=False, num_buckets=32, max_distance=128)
    assert torch.equal(t5_bucket(n, 32, 128), theirs)  # their argument is j − i (memory minus query)


def test_t5_bias_is_the_table_at_the_bucket() -> None:
    pos = _pos("t5", num_buckets=8, max_distance=20)
    with torch.no_grad():
        pos.table.weight.copy_(torch.randn(8, NH))
    T = 24
    bias = pos.attn_bias(T, torch.device("cpu"), torch.float32)
    for i in range(T):
        for j in range(T):
            expected = pos.table.weight[SMALL_BUCKETS[i - j]] if j <= i else torch.full((NH,), float("-inf"))
            assert torch.equal(bias[:, i, j], expected), (i, j)
    # with a cache: queries 20..23 against keys 0..23 are those rows
    assert torch.equal(pos.attn_bias(4, torch.device("cpu"), torch.float32, offset=20), bias[:, 20:])


def test_t5_needs_log_buckets_to_span() -> None:
    with pytest.raises(ValueError, match=r"position.max_distance=16 must exceed position.num_buckets / 2 = 16"):
        _pos("t5", num_buckets=32, max_distance=16)


# ---- xPos -----------------------------------------------------------------------------------------------------------


def _xpos_by_hand(x: torch.Tensor, n: int, theta: float, gamma: float, base: float, sign: int) -> list[float]:
    """Pair j = (x_2j, x_2j+1) rotated by n·θ_j, θ_j = theta^(−2j/d), times ζ_j^(sign·n/B), ζ_j = (2j/d + γ)/(1 + γ)."""
    d, out = x.numel(), []
    for j in range(d // 2):
        a, s = n * theta ** (-2 * j / d), ((2 * j / d + gamma) / (1 + gamma)) ** (sign * n / base)
        x0, x1 = x[2 * j].item(), x[2 * j + 1].item()
        out += [s * (x0 * math.cos(a) - x1 * math.sin(a)), s * (x1 * math.cos(a) + x0 * math.sin(a))]
    return out


def _same_vector_everywhere(pos, q: torch.Tensor, k: torch.Tensor, T: int, offset: int = 0):
    rq, rk = pos.rotate(q.expand(1, 1, T, q.numel()).contiguous(), k.expand(1, 1, T, k.numel()).contiguous(), offset)
    return rq[0, 0], rk[0, 0]


def test_xpos_rotation_and_scale_by_hand() -> None:
    theta, gamma, base, T = 100.0, 0.4, 8.0, 6
    pos = _pos("xpos", theta=theta, gamma=gamma, scale_base=base)
    q, k = torch.randn(HS, dtype=torch.float64), torch.randn(HS, dtype=torch.float64)
    rq, rk = _same_vector_everywhere(pos, q, k, T)
    for n in range(T):
        torch.testing.assert_close(rq[n].tolist(), _xpos_by_hand(q, n, theta, gamma, base, +1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rk[n].tolist(), _xpos_by_hand(k, n, theta, gamma, base, -1), rtol=1e-6, atol=1e-6)
    assert torch.equal(rq[0], q) and torch.equal(rk[0], k)  # position 0: no rotation, scale 1
    # ζ_0 = 0.4 / 1.4, ζ_1 = 0.9 / 1.4: at n = 5 the first pair's norm shrinks by (2/7)^(5/8), the second's by (9/14)^(5/8)
    assert rq[5, :2].norm().item() == pytest.approx((2 / 7) ** (5 / 8) * q[:2].norm().item(), rel=1e-6)
    assert rq[5, 2:].norm().item() == pytest.approx((9 / 14) ** (5 / 8) * q[2:].norm().item(), rel=1e-6)


def test_xpos_dot_product_depends_only_on_the_distance_and_is_the_formula() -> None:
    """q_n·k_m = Σ_j ζ_j^(Δ/B) ((q0 k0 + q1 k1) cos Δθ_j + (q0 k1 − q1 k0) sin Δθ_j), Δ = n − m, per pair j: the same
    for every n at one Δ (and for a cache's offset), and q·k itself at n = m (scale 1)."""
    theta, gamma, base, T = 100.0, 0.4, 8.0, 12
    pos = _pos("xpos", theta=theta, gamma=gamma, scale_base=base)
    q, k = torch.randn(HS, dtype=torch.float64), torch.randn(HS, dtype=torch.float64)
    rq, rk = _same_vector_everywhere(pos, q, k, T)
    dots = rq @ rk.T  # dots[n, m]
    for delta in range(T):
        expected = sum(((2 * j / HS + gamma) / (1 + gamma)) ** (delta / base)
                       * ((q[2 * j] * k[2 * j] + q[2 * j + 1] * k[2 * j + 1]) * math.cos(delta * theta ** (-2 * j / HS))
                          + (q[2 * j] * k[2 * j + 1] - q[2 * j + 1] * k[2 * j]) * math.sin(delta * theta ** (-2 * j / HS)))
                       for j in range(HS // 2)).item()
        diag = torch.diagonal(dots, offset=-delta)  # entries with n − m = delta
        torch.testing.assert_close(diag, torch.full_like(diag, expected), rtol=1e-5, atol=1e-6)  # float32 tables
    torch.testing.assert_close(torch.diagonal(dots), (q @ k).expand(T), rtol=1e-6, atol=1e-6)
    oq, ok = _same_vector_everywhere(pos, q, k, 4, offset=8)  # the last 4 positions, as a cache asks for them
    torch.testing.assert_close(oq, rq[8:], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ok, rk[8:], rtol=1e-6, atol=1e-7)


def test_xpos_refuses_an_odd_head_dim_and_a_length_past_its_dtype() -> None:
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=1, d_model=30, n_head=6, position={"name": "xpos"}))  # head_dim 5
    with pytest.raises(ValueError, match=r"position=xpos rotates pairs.*5 is odd"):
        validate(cfg)
    pos = _pos("xpos")  # ζ_0 = 2/7: fp16's smallest normal 2^-14 is reached at n = 512·14 ln 2 / ln 3.5 ≈ 3966
    x = torch.zeros(1, 1, 1, HS)
    pos.rotate(x.half(), x.half(), offset=3960)
    with pytest.raises(ValueError, match=r"position=xpos at length 4000: .*torch.float16's range"):
        pos.rotate(x.half(), x.half(), offset=3999)
    pos.rotate(x, x, offset=30_000)  # fp32 reaches ~35k


# ---- FIRE -----------------------------------------------------------------------------------------------------------


def _fire(L: float = 6.0):
    """FIRE with 2 heads, a width of 3 and weights chosen by hand: c = 0.5, L = 1.5 · init_threshold."""
    pos = _pos("fire", mlp_width=3, init_threshold=L / 1.5)
    with torch.no_grad():
        pos.c.fill_(0.5)
        pos.threshold_mult.fill_(-1.5)  # |s|: the sign does not matter
        pos.w1.copy_(torch.tensor([1.0, -2.0, 0.5]))
        pos.b1.copy_(torch.tensor([0.0, 0.5, -0.1]))
        pos.out.weight.copy_(torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 2.0]]))
        pos.out.bias.copy_(torch.tensor([0.1, -0.2]))
    return pos


def test_fire_bias_by_hand() -> None:
    """x = ln(0.5(i − j) + 1) / ln(0.5·max(6, i) + 1); h = relu([x, −2x + 0.5, 0.5x − 0.1]);
    bias = [h0 + 2h1 + 3h2 + 0.1, −h0 + 0.5h1 + 2h2 − 0.2]."""
    bias = _fire().attn_bias(9, torch.device("cpu"), torch.float32)
    # (0, 0): x = 0, h = (0, 0.5, 0): (1.1, 0.05). (3, 1): x = ln 2 / ln 4 = 0.5, h = (0.5, 0, 0.15): (1.05, −0.4).
    # (8, 0): past L, x = ln 5 / ln 5 = 1, h = (1, 0, 0.4): (2.3, −0.4). (7, 4): x = ln 2.5 / ln 4.5, h = (x, 0, x/2 − .1)
    x74 = math.log(2.5) / math.log(4.5)
    expected = {(0, 0): (1.1, 0.05), (3, 1): (1.05, -0.4), (8, 0): (2.3, -0.4),
                (7, 4): (x74 + 3 * (x74 / 2 - 0.1) + 0.1, -x74 + 2 * (x74 / 2 - 0.1) - 0.2)}
    for (i, j), value in expected.items():
        torch.testing.assert_close(bias[:, i, j], torch.tensor(value), rtol=1e-5, atol=1e-5)
    assert torch.isneginf(bias[:, 2, 3]).all() and torch.isneginf(bias[:, 0, 8]).all()


def test_fire_bias_is_the_mlp_of_the_formula_everywhere() -> None:
    pos = _fire()
    T = 9
    bias = pos.attn_bias(T, torch.device("cpu"), torch.float32)
    W, b = pos.out.weight.tolist(), pos.out.bias.tolist()
    for i in range(T):
        for j in range(i + 1):
            x = math.log(0.5 * (i - j) + 1) / (math.log(0.5 * max(6.0, i) + 1) + 1e-6)
            h = [max(0.0, w * x + c) for w, c in zip([1.0, -2.0, 0.5], [0.0, 0.5, -0.1])]
            want = [sum(W[o][u] * h[u] for u in range(3)) + b[o] for o in range(NH)]
            torch.testing.assert_close(bias[:, i, j], torch.tensor(want), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pos.attn_bias(3, torch.device("cpu"), torch.float32, offset=6), bias[:, 6:])


def test_fire_keeps_its_first_layer_spread_under_the_models_init() -> None:
    """f_θ's first layer keeps U(−1, 1) weights and biases (its ReLUs' kinks spread over the input), the output layer
    is the init scheme's (init=gpt2: zero bias)."""
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(vocab_size=50, n_layer=1, d_model=32, n_head=4, position={"name": "fire"})))
    fire = model.pos
    assert fire.b1.abs().min() > 0 and fire.b1.abs().max() <= 1 and (fire.b1 < 0).any() and (fire.b1 > 0).any()
    assert fire.out.bias.abs().max() == 0
    assert fire.c.item() == pytest.approx(0.1) and fire.threshold_mult.item() * fire.init_threshold == 512.0


# ---- the whole model, every new scheme ------------------------------------------------------------------------------

# settings that reach each scheme's regimes within 24 tokens: T5's log buckets and last bucket, xPos's scale, FIRE's L
SHORT = {"t5": {"num_buckets": 8, "max_distance": 12}, "xpos": {"scale_base": 8.0}, "fire": {"init_threshold": 6.0}}


def _sharp_model(name: str) -> GPT:
    """A 2-layer model whose attention and position weights are large enough that a mistake shows in the logits."""
    torch.manual_seed(0)
    model = GPT(validate(GPTConfig(vocab_size=40, n_layer=2, d_model=32, n_head=4, max_seq_len=32,
                                   norm={"name": "rms"}, position={"name": name, **SHORT[name]}))).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("attn.c_attn.weight"):
                p.mul_(10)
            elif pname in ("pos.table.weight", "pos.out.weight"):  # T5's table, FIRE's output layer: O(1) biases
                p.copy_(torch.randn_like(p) * 2)
    return model


@pytest.mark.parametrize("name", NEW)
def test_future_tokens_do_not_change_earlier_logits(name: str) -> None:
    model = _sharp_model(name)
    idx = torch.randint(0, 40, (2, 24))
    changed = idx.clone()
    changed[:, 15:] = torch.randint(0, 40, (2, 9))
    with torch.no_grad():
        a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :15], b[:, :15], rtol=0, atol=1e-5)
    assert not torch.allclose(a[:, 15:], b[:, 15:], atol=1e-3)


@pytest.mark.parametrize("name", NEW)
def test_the_kv_cache_gives_the_full_forward(name: str) -> None:
    """A prompt of 5, then one token at a time to 24: the cached logits are the full forward's."""
    model = _sharp_model(name)
    idx = torch.randint(0, 40, (2, 24))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(2)
        steps = [model(idx[:, :5], cache=cache)] + [model(idx[:, t:t + 1], cache=cache) for t in range(5, 24)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, **TOL)


@pytest.mark.parametrize("name", NEW)
def test_a_composed_model_runs_forward_and_backward(name: str) -> None:
    model = build_model(compose([f"position={name}", "model.n_layer=2", "model.d_model=32", "model.n_head=4",
                                 "model.max_seq_len=32"]))
    idx = torch.randint(0, model.cfg.vocab_size, (2, 16))
    loss = model(idx, idx)
    assert math.isfinite(loss.item())
    loss.backward()
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    for pname, p in model.pos.named_parameters():  # the scheme's own weights learn
        assert p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", NEW)
def test_what_the_new_schemes_refuse(name: str) -> None:
    base = dict(vocab_size=50, n_layer=1, d_model=32, n_head=4, max_seq_len=16)
    with pytest.raises(ValueError, match=rf"position='{name}' does not take \['per_document'\]"):
        validate(GPTConfig(**base, position={"name": name, "per_document": True}))
    with pytest.raises(ValueError, match=rf"rope_scaling='linear' needs position=rope.*position='{name}'"):
        validate(resolve(GPTConfig(**base, position={"name": name}, rope_scaling={"name": "linear", "factor": 2.0})))
    for axes in ({"norm": {"name": "layer"}}, {"norm": {"name": "rms"}, "ffn": {"name": "swiglu"}}):  # GPT-2, Llama
        cfg = resolve(GPTConfig(**base, position={"name": name}, **axes))
        with pytest.raises(NotRepresentable, match=rf"^position='{name}'"):
            family(cfg)


def test_the_biases_state_their_memory() -> None:
    """T5's and FIRE's (nh, T, T) bias and SDPA's scores under an explicit mask are counted, as ALiBi's; xPos has no
    bias."""
    n_head, T, batch = 4, 64, 2
    scores = batch * n_head * T * T * 4
    for name in ("t5", "fire"):
        bias = POSITIONS[name](32, 8, n_head, T, T, {"name": "none"}).attn_bias(T, torch.device("cpu"), torch.float32)
        assert POSITIONS[name].attention_bytes(n_head, T, batch) >= 2 * bias.numel() * bias.element_size() + scores
    assert POSITIONS["fire"].attention_bytes(n_head, T, batch) >= T * T * 32 * 4 * 2  # f_θ's hidden layer
    assert POSITIONS["xpos"].attention_bytes(n_head, 100_000, batch) == 0
