"""attention=diff: differential attention (`DiffAttention`)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.attention.mha import MHA
from lmlab.model.attention.score import attend, explicit_weights

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.position import Position


class DiffAttention(MHA):
    """Differential attention (Ye et al., 2024, "Differential Transformer"): the difference of two softmax maps
    cancels the attention noise they share, A = softmax(Q₁K₁ᵀ/√d) − λ·softmax(Q₂K₂ᵀ/√d), out = A·V, then each
    differential head is RMS-normalised and scaled by (1 − λ_init). The query/key heads pair up, (2j, 2j + 1) being
    (Q₁, Q₂) and (K₁, K₂) of differential head j, which weighs the values of both, V = [v_2j; v_2j+1] (width 2d): the
    paper's h = d_model / 2d heads, with lmlab's parameter count (the same fused QKV and output projection) and its
    head geometry (RoPE rotates each head of size d). λ = exp(λ_q1·λ_k1) − exp(λ_q2·λ_k2) + λ_init, the four vectors
    of size d learned per layer (init N(0, 0.1)), λ_init = 0.8 − 0.6·exp(−0.3·(l − 1)) at layer l = 1 .. L. Softmax
    scores only; windows, documents and softcaps apply to both maps."""

    scaled_dot_product = False  # its own formula: two maps per head pair (tests/unit/model/attention/test_window.py)
    no_qk_clip = "each head's weights are a difference of two maps, whose logits a per-head scale does not bound"
    runs_hooks = MHA.runs_hooks - {"extras", "select", "attend", "token_weights"}  # its own weights (`mix`, `probs`)
    refuses = {"paired_heads": "attention=diff pairs its heads already, (2j, 2j + 1) into the two maps of a "
                               "differential head",
               **dict.fromkeys(("score", "sinks", "gate"), "attention=diff is a difference of two softmax maps, "
                               "without sinks or a gate"),
               **dict.fromkeys(("forget_gate", "mem_kv"), "attention=diff pairs two maps per differential head, "
                               "where a per-head forget gate or memory keys have no form (Ye et al., 2024 has "
                               "neither)")}

    def __init__(self, cfg: GPTConfig, layer: int = 0, **shared: Any) -> None:
        super().__init__(cfg, layer, **shared)
        if self.n_head % 2:
            raise ValueError(f"attention=diff pairs its heads into differential heads: model.n_head={self.n_head} "
                             f"must be even")
        if (name := cfg.position.get("name")) in ("alibi", "t5", "fire"):
            raise ValueError(f"attention=diff with position={name}: its bias is per head, a differential head has "
                             f"two maps; use position=rope")
        d = self.head_dim
        self.lambda_init = 0.8 - 0.6 * math.exp(-0.3 * layer)  # l - 1 = layer (0-based)
        self.lambda_q1, self.lambda_k1, self.lambda_q2, self.lambda_k2 = (
            nn.Parameter(torch.randn(d) * 0.1) for _ in range(4))
        self.subln = nn.Parameter(torch.ones(2 * d))  # the per-head RMSNorm's gain, over a differential head's 2d

    def lam(self) -> torch.Tensor:
        return (torch.exp((self.lambda_q1 * self.lambda_k1).sum()) - torch.exp((self.lambda_q2 * self.lambda_k2).sum())
                + self.lambda_init)

    @staticmethod
    def _pairs(v: torch.Tensor) -> torch.Tensor:
        """(B, h, S, d) -> (B, h/2, S, 2d): the values of heads 2j and 2j + 1 side by side."""
        return torch.cat((v[:, 0::2], v[:, 1::2]), dim=-1)

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: Position, offset: int,
            docs: tuple[torch.Tensor, torch.Tensor] | None, extras: dict[str, Any], scale: float | None = None
            ) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        values = self._pairs(v)
        y1 = attend(q[:, 0::2], k[:, 0::2], values, self.score, self.scale, pos, offset, p, self.window, self.softcap,
                    docs)
        y2 = attend(q[:, 1::2], k[:, 1::2], values, self.score, self.scale, pos, offset, p, self.window, self.softcap,
                    docs)
        y = F.rms_norm(y1 - self.lam().to(y1.dtype) * y2, (2 * self.head_dim,), self.subln, eps=1e-5)
        y = y * (1 - self.lambda_init)  # (B, h/2, T, 2d)
        B, h2, T, _ = y.shape  # back to (B, nh, T, d): differential head j's halves as heads 2j, 2j + 1
        return y.view(B, h2, T, 2, self.head_dim).transpose(2, 3).reshape(B, 2 * h2, T, self.head_dim)

    @property
    def sums_to_one(self) -> bool:
        return False  # A₁ − λA₂: its rows sum to 1 − λ and it has negative entries

    def probs(self, x: torch.Tensor, pos: Position, doc: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The differential maps A = A₁ − λA₂ (B, nh/2, T, T) and the max logit of either map (B, nh/2)."""
        q, k, _ = self.qkv(x, pos, 0, doc, mix=False)
        docs = (doc, doc) if self.doc_mask else None
        a1, l1 = explicit_weights(q[:, 0::2], k[:, 0::2], self.score, self.scale, pos, 0, self.window, self.softcap,
                                  docs)
        a2, l2 = explicit_weights(q[:, 1::2], k[:, 1::2], self.score, self.scale, pos, 0, self.window, self.softcap,
                                  docs)
        return a1 - self.lam() * a2, torch.maximum(l1.amax(dim=(-2, -1)), l2.amax(dim=(-2, -1)))


OPTIONS = {"diff": DiffAttention}
