"""attention=cosine: scaled cosine attention (Liu et al., 2022, Swin Transformer V2; the QK-norm of Henry et al., 2020).
The logits are a learned temperature times the cosine of the query and the key, not their scaled dot product:

    logit_h(i, j) = τ_h · q_i·k_j / (‖q_i‖ ‖k_j‖)        τ_h = exp(s_h), s_h learned per head, τ ≤ 100

so a logit is bounded by τ whatever the activations' size: a large q or k cannot saturate the softmax (Swin V2's reason,
at depth and scale) and the attention entropy cannot collapse by the logits growing. τ starts at `tau_init` (Swin V2:
10) and is clamped at 100 as Swin V2 clamps it. RoPE rotates q and k before the cosine (a rotation keeps norms), ALiBi's
bias adds to τ·cos, and the masks, windows, documents, softcap, sinks, gate and KV cache are MHA's; so are the forget
gate (its decay adds to τ·cos), the memory keys (unit vectors too, as the tokens' keys) and paired heads (τ_h·cos over
the pair's slots, attention.paired_heads). The score is the softmax; `temperature` and `logn_scaling`, a fixed scale on
the logits, are the learned τ's job here and are refused.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.attention.mha import MHA, Geometry
from lmlab.registry import PositiveFloat

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import LayerCache
    from lmlab.model.position import Position

MAX_TAU = 100.0  # Swin V2's clamp of the learned logit scale


class CosineAttention(MHA):
    """MHA whose logits are τ_h·cos(q, k) (`lmlab.model.attention.cosine`)."""

    scaled_dot_product = False  # its own formula: τ·cos (tests/unit/model/attention/test_cosine_attention.py)
    no_qk_clip = "its logits are τ·cos, bounded by the learnt τ already; rescaling W_q and W_k changes nothing"

    refuses = dict.fromkeys(("score", "logn_scaling", "temperature"),
                            "attention=cosine weighs τ·cos(q, k) with the softmax, its logits' scale learnt (τ, from "
                            "attention.tau_init)")

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, tau_init: PositiveFloat = 10.0, **shared: Any) -> None:
        if tau_init > MAX_TAU:
            raise ValueError(f"attention.tau_init={tau_init} is above τ's clamp of {MAX_TAU:g} (Swin V2's)")
        super().__init__(cfg, layer, **shared)
        self.log_tau = nn.Parameter(torch.full((self.n_head,), math.log(tau_init)))  # s_h: τ_h = exp(s_h)

    @classmethod
    def geometry(cls, cfg: GPTConfig, **params: Any) -> Geometry:
        mha = MHA.geometry(cfg, **params)
        return dataclasses.replace(mha, n_params=mha.n_params + cfg.n_head)

    @property
    def tau(self) -> torch.Tensor:
        """τ_h per head, clamped at MAX_TAU."""
        return self.log_tau.clamp(max=math.log(MAX_TAU)).exp()

    def cosine(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Unit queries times τ_h and unit keys: their dot products are the logits (q (B, h, T, d), k (B, hkv, S, d))."""
        return F.normalize(q, dim=-1) * self.tau.to(q.dtype)[:, None, None], F.normalize(k, dim=-1)

    def extras(self, x: torch.Tensor, cache: LayerCache | None = None) -> dict[str, Any]:
        """The memory keys as unit vectors, as `cosine` makes the tokens' keys."""
        out = super().extras(x, cache)
        if "mem" in out:
            out["mem"] = (F.normalize(out["mem"][0], dim=-1), out["mem"][1])
        return out

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: Position, offset: int,
            docs: tuple[torch.Tensor, torch.Tensor] | None, extras: dict[str, Any], scale: float | None = None
            ) -> torch.Tensor:
        q, k = self.cosine(q, k)  # τ·cos: the logits' scale is τ's (under paired_heads, over the pair's slots)
        return super().mix(q, k, v, pos, offset, docs, extras, scale=1.0)

    def probs(self, x: torch.Tensor, pos: Position, doc: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = self.qkv(x, pos, 0, doc, mix=False)
        q, k = self.cosine(q, k)
        return self.token_weights(q, k, x, pos, doc, scale=1.0)


OPTIONS = {"cosine": CosineAttention}
