"""attention.forget_gate: a forget gate per head (Lin et al., 2025, "Forgetting Transformer", FoX),
f_t = σ(w_h·x_t + b_h) from the sublayer's input, and the logits get D_ij = Σ_{l=j+1..i} log f_l = c_i − c_j,
c_t = Σ_{l≤t} log f_l (a key weighed down by the product of the gates since it; lmlab.model.mask.forget_bias);
`forget_bias` is b_h at init (FoX: 0, so f ≈ 1/2). Softmax scores; the KV cache keeps each key's c_j."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.attention.parts import Part, Widths

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class ForgetGate(Part):
    rank = 4
    requires = {"score": (("softmax", "softmax_plus"), "the gates weigh keys down through exp(c_i − c_j), a softmax "
                                                       "score's")}

    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, forget_gate: bool = False, forget_bias: float = 0.0) -> None:
        if not forget_gate:
            raise ValueError(f"attention.forget_bias={forget_bias} needs attention.forget_gate=true (it is the "
                             f"forget gate's bias at init)")
        attn.forget = nn.Linear(cfg.d_model, attn.n_head, bias=False)  # w_h (a hidden matrix)
        # b_h, its own parameter: the init schemes zero the biases of Linear layers
        attn.forget_bias = nn.Parameter(torch.full((attn.n_head,), float(forget_bias)))

    @classmethod
    def n_params(cls, cfg: GPTConfig, widths: Widths, **keys: Any) -> int:
        return (cfg.d_model + 1) * widths.heads

    @classmethod
    def cache_width(cls, cfg: GPTConfig, widths: Widths, **keys: Any) -> int:
        return widths.heads  # each key's c_j per head

    def extras(self, attn: nn.Module, x: torch.Tensor, cache: Any) -> dict[str, Any]:
        """The cumulative sums c_t = Σ_{l≤t} log σ(w_h·x_l + b_h), in fp32 at least, as FoX's: of these T tokens
        (B, nh, T) and of every key read (B, nh, S), the cached ones' first."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        log_f = F.logsigmoid(attn.forget(x).to(dtype) + attn.forget_bias.to(dtype))  # (B, T, nh)
        c = log_f.cumsum(dim=1).transpose(1, 2)  # (B, nh, T)
        return {"forget": (c, c) if cache is None else cache.append_forget(c)}

    def causal_only(self, attn: nn.Module) -> str | None:
        return ("attention.forget_gate=true decays each key by the gates between it and a later query (FoX), which "
                "has no form for the keys after a query: use attention.forget_gate=false")


PARTS = {"forget_gate": ForgetGate}
