"""Attention scores: relu²/n and softmax_plus against their formulas on numbers worked by hand; the shared log_L(n)
factor; softmax unchanged (the hand-written softmax attention of test_attention); every score causal, with GQA,
ALiBi and qk-norm; the monitor's weights (`probs`) and whether rows sum to one."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS
from lmlab.model.attention.score import SCORES, attend, log_ratio, scale_queries
from lmlab.model.gpt import GPT, validate
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.registry import build
from lmlab.run.monitor import StabilityMonitor
from tests.unit.model.attention.test_attention import _explicit

TOL = dict(rtol=1e-6, atol=1e-6)
NOPE = build("position", POSITIONS, {"name": "none"}, 2, 2, 1, 8, 8, {"name": "none"})

# One head, d = 2, scale 1: q_i·k_j by hand.
Q = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]])
K = torch.tensor([[2.0, 0.0], [-1.0, 5.0], [1.0, 1.0]])
V = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
# q·k: row 0 [2, -, -]; row 1 [2, 4, -]; row 2 [0, 5, 1]


def _attend(score: str, train_len: int = 4, offset: int = 0) -> torch.Tensor:
    q, k, v = Q[None, None, offset:], K[None, None], V[None, None]
    s = SCORES[score](train_len)
    return attend(scale_queries(q, s, offset), k, v, s, 1.0, NOPE, offset)[0, 0]


def test_log_ratio_numbers() -> None:
    n = torch.tensor([1.0, 2.0, 4.0, 16.0, 8.0])
    torch.testing.assert_close(log_ratio(n, 4), torch.tensor([0.0, 0.5, 1.0, 2.0, 1.5]))


def test_relu2_by_hand() -> None:
    """A = relu²(q·k)/n_i with n_i = i + 1: rows [4/1], [4/2, 16/2], [0, 25/3, 1/3]."""
    expected = torch.stack([4 * V[0], 2 * V[0] + 8 * V[1], (25 * V[1] + V[2]) / 3])
    torch.testing.assert_close(_attend("relu2"), expected, **TOL)


def test_relu2_with_a_cached_prefix_uses_the_queries_positions() -> None:
    """Queries 1 and 2 after one cached token: n = 2, 3 (not 1, 2), so they equal rows 1, 2 of the full text."""
    torch.testing.assert_close(_attend("relu2", offset=1), _attend("relu2")[1:], **TOL)


def test_relu2_masks_after_the_square() -> None:
    """Negative logits give 0 and masked (future) entries are 0, not relu²(-inf) or relu²(logit)."""
    s = SCORES["relu2"](8)
    logits = torch.tensor([[-3.0, 9.0], [2.0, -1.0]])
    mask = torch.tensor([[True, False], [True, True]])
    a = s.weights(logits, mask, torch.tensor([1.0, 2.0]))
    torch.testing.assert_close(a, torch.tensor([[0.0, 0.0], [2.0, 0.0]]))


def test_softmax_plus_by_hand() -> None:
    """softmax(log_L(n_i) · q·k) with L = 4: factors 0, 1/2, log_4(3)."""
    f = math.log(3) / math.log(4)
    row1 = torch.tensor([math.exp(1.0), math.exp(2.0)])
    row2 = torch.tensor([math.exp(0.0), math.exp(5 * f), math.exp(f)])
    expected = torch.stack([V[0], (row1 / row1.sum()) @ V[:2], (row2 / row2.sum()) @ V])
    torch.testing.assert_close(_attend("softmax_plus"), expected, **TOL)


def test_softmax_by_hand() -> None:
    row1 = torch.tensor([math.exp(2.0), math.exp(4.0)])
    row2 = torch.tensor([math.exp(0.0), math.exp(5.0), math.exp(1.0)])
    expected = torch.stack([V[0], (row1 / row1.sum()) @ V[:2], (row2 / row2.sum()) @ V])
    torch.testing.assert_close(_attend("softmax"), expected, **TOL)


@pytest.mark.parametrize("position", sorted(POSITIONS))
def test_score_softmax_is_todays_attention(position: str) -> None:
    """`score: softmax` (the YAML default) is the hand-written softmax attention, on SDPA's fast path."""
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16, bias=True,
                    attention={"name": "mha", "score": "softmax"}))
    attn = build("attention", ATTENTIONS, cfg.attention, cfg).eval()
    assert SCORES["softmax"].sdpa
    pos = build("position", POSITIONS, {"name": position}, 32, 8, 4, 16, 16, {"name": "none"})
    x = torch.randn(2, 7, 32)
    torch.testing.assert_close(attn(x, pos), _explicit(attn, pos, x, 8 ** -0.5), rtol=1e-5, atol=1e-6)


def test_softmax_plus_and_logn_scaling_share_the_factor_but_not_the_range() -> None:
    """logn_scaling: log_L(n) clamped >= 1, past L only; softmax_plus: log_L(n) at every n (< 1 before L)."""
    n = torch.arange(1.0, 9.0)
    plus = SCORES["softmax_plus"](4).query_scale(n)
    torch.testing.assert_close(plus, log_ratio(n, 4))
    assert plus[0] == 0 and plus[3] == 1 and plus[7] == 1.5
    assert SCORES["softmax"](4).query_scale(n) is None and SCORES["relu2"](4).query_scale(n) is None
    with pytest.raises(ValueError, match="logn_scaling.*softmax_plus"):
        validate(GPTConfig(vocab_size=50, n_head=4,
                           attention={"name": "mha", "score": "softmax_plus", "logn_scaling": True}
                  ))


def test_an_unknown_score_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"attention.score='relu3' is not an option.*'relu2'"):
        validate(GPTConfig(vocab_size=50, n_head=4, attention={"name": "mha", "score": "relu3"}))


CASES = {"mha": {}, "gqa+qk_norm": {"attention": {"name": "gqa", "qk_norm": True}, "n_kv_head": 2},
         "alibi": {"position": {"name": "alibi"}}, "rope": {"position": {"name": "rope"}}}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("score", sorted(SCORES))
def test_every_score_is_causal(score: str, case: str) -> None:
    kw = dict(CASES[case])
    attention = {"name": "mha", **kw.pop("attention", {}), "score": score}
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16, attention=attention, **kw))
    idx = torch.randint(0, 50, (2, 12))
    idx2 = idx.clone()
    idx2[:, 6:] = (idx[:, 6:] + 1) % 50
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a[:, 6:], b[:, 6:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("score", sorted(SCORES))
def test_probs_are_the_scores_weights(score: str) -> None:
    """The monitor's weights: rows sum to one exactly when the score says so; relu2 rows are relu²(logits)/n."""
    cfg = resolve(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16,
                    attention={"name": "mha", "score": score}))
    attn = build("attention", ATTENTIONS, cfg.attention, cfg)
    pos = build("position", POSITIONS, {"name": "alibi"}, 32, 8, 4, 16, 16, {"name": "none"})
    x = torch.randn(2, 6, 32) * 3
    p, max_logit = attn.probs(x, pos)
    assert p.shape == (2, 4, 6, 6) and max_logit.shape == (2, 4)
    assert torch.all(p.triu(1) == 0)
    rows = p.sum(-1)
    if SCORES[score].sums_to_one:
        torch.testing.assert_close(rows, torch.ones_like(rows))
    else:
        assert not torch.allclose(rows, torch.ones_like(rows), atol=1e-3)
        q, k, _ = attn.qkv(x, pos)
        logits = q @ k.transpose(-2, -1) * attn.scale + pos.attn_bias(6, x.device, x.dtype)
        n = torch.arange(1.0, 7.0)[:, None]
        torch.testing.assert_close(p, torch.relu(logits).square().tril() / n, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("block", ["transformer", "gau"])
@pytest.mark.parametrize("score", sorted(SCORES))
def test_monitor_logs_an_entropy_only_for_distributions(score: str, block: str) -> None:
    """relu2's rows are not distributions: no attn/entropy for them, the max logit still; found in either block."""
    gau = block == "gau"  # the unit reads its own block.score; attention.* is a transformer's
    spec = {"name": "gau", "s": 16, "score": score} if gau else {"name": "transformer"}
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, max_seq_len=16, block=spec,
                          attention={"name": "mha"} if gau else {"name": "mha", "score": score}))
    monitor = StabilityMonitor()
    monitor._attn_in = {i: (torch.randn(2, 6, 32), None) for i in range(2)}  # (input, document numbers)
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=1)
    out = monitor._attention_stats(trainer, SimpleNamespace(model=model))
    assert ("attn/entropy/layer_00" in out) == ("attn/entropy/layer_01" in out) == SCORES[score].sums_to_one
    assert math.isfinite(out["attn/max_logit/layer_01"])
    if SCORES[score].sums_to_one:
        assert 0 < out["attn/entropy/layer_00"] < math.log(6)


@pytest.mark.parametrize("attention", sorted(ATTENTIONS))
def test_the_monitors_attention_figures_for_every_attention_option(attention: str) -> None:
    """Entropy where the rows are distributions, as the option says (`sums_to_one`: diff's A₁ − λA₂ are not, nor
    talking heads' learned mixes of the weights: none logged), the max logit always."""
    model = GPT(GPTConfig(vocab_size=50, n_layer=2, d_model=32, n_head=4, n_kv_head=2, max_seq_len=16,
                          attention={"name": attention}))
    monitor = StabilityMonitor()
    monitor._attn_in = {i: (torch.randn(2, 6, 32), None) for i in range(2)}
    trainer = SimpleNamespace(strategy=SimpleNamespace(root_device=torch.device("cpu")), world_size=1)
    out = monitor._attention_stats(trainer, SimpleNamespace(model=model))
    distributions = model.h[0].attn.sums_to_one
    assert distributions == (attention not in ("diff", "talking_heads"))
    assert ("attn/entropy/layer_00" in out) == distributions
    assert math.isfinite(out["attn/max_logit/layer_01"])
    if distributions:
        assert 0 < out["attn/entropy/layer_00"] < math.log(6)
