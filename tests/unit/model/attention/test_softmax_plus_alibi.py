"""softmax_plus with a position bias (ALiBi): the decision, tested. The entropy-invariant factor log_L(n) multiplies
the content logits q·k/√d only, never ALiBi's bias −m·(i − j) — as attention.logn_scaling does — so ALiBi's distance
prior stays the length-independent prior it is trained as (its extrapolation rests on that), and one rule holds for
every position scheme: RoPE has no bias, so there the two readings agree. The other reading, log_L(n)·(q·k/√d + bias),
would sharpen the recency prior past L by the same factor; the test measures how far apart the two are."""

from __future__ import annotations

import math

import torch

from lmlab.model.attention.score import SCORES, attend, explicit_weights, scale_queries
from lmlab.model.position import POSITIONS
from lmlab.registry import build

H, T, D, L = 4, 16, 8, 8  # 4 heads of 8 dims, 16 queries, trained length 8: factors log_8(n) from 0 to 1.33


def test_softmax_plus_scales_the_content_logits_not_alibis_bias() -> None:
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, H, T, D) * 2 for _ in range(3))
    pos = build("position", POSITIONS, {"name": "alibi"}, H * D, D, H, T, T, {"name": "none"})
    score = SCORES["softmax_plus"](L)
    got, _ = explicit_weights(scale_queries(q, score, 0), k, score, 1 / math.sqrt(D), pos)
    n = torch.arange(1.0, T + 1)[:, None]  # the keys query i reads
    kappa = torch.log(n) / math.log(L)
    content = q @ k.transpose(-2, -1) / math.sqrt(D)
    bias = pos.attn_bias(T, q.device, q.dtype)  # (h, T, T): −m·(i − j), −inf above the diagonal
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    decided = torch.softmax((kappa * content + bias).masked_fill(~causal, float("-inf")), -1)
    torch.testing.assert_close(got, decided, rtol=1e-5, atol=1e-6)
    finite_bias = bias.masked_fill(~causal, 0.0)
    other = torch.softmax((kappa * (content + finite_bias)).masked_fill(~causal, float("-inf")), -1)
    gap = (other - decided).abs().max().item()
    assert 0.05 < gap < 0.2, gap  # 0.107 here (seed 0): up to a tenth of a weight, a real choice
    # the fast path (SDPA with the bias as its mask) computes the same weights
    out = attend(scale_queries(q, score, 0), k, v, score, 1 / math.sqrt(D), pos)
    torch.testing.assert_close(out, decided @ v, rtol=1e-4, atol=1e-5)
