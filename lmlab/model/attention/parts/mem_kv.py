"""attention.mem_kv: M learned key/value pairs per key/value head (Burtsev et al., 2020, "Memory Transformer";
x-transformers' `attn_num_mem_kv`; Darcet et al., 2023's registers) in front of the keys: every query reads them,
with no position (unrotated: under RoPE a key at position 0; a zero position bias), no decay, under any window or
document mask; parameters, not cached; normed with the keys under attention.qk_norm; init N(0, 1) as
x-transformers'. Columns of the softmax (score=softmax), without sinks (a memory pair with a zero value is a sink)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.model.attention.parts import Part, Widths
from lmlab.registry import NonNegativeInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


class MemoryKV(Part):
    rank = 5
    takes_share = True  # the tokens' weights leave out the memory's share
    requires = {"score": (("softmax",), "memory keys are columns of the softmax, which the keys counted by the other "
                                        "scores leave out")}
    # the monitor's sink share (1 − the tokens' weights) would count the memory's too
    excludes = {"sinks": "a memory pair is a learned sink already (one whose value is zero, its logit read from the "
                         "query); use one of the two"}

    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, mem_kv: NonNegativeInt = 0) -> None:
        attn.mem_k = nn.Parameter(torch.randn(attn.n_kv_head, mem_kv, attn.qk_dim))
        attn.mem_v = nn.Parameter(torch.randn(attn.n_kv_head, mem_kv, attn.v_dim))

    @classmethod
    def n_params(cls, cfg: GPTConfig, widths: Widths, **keys: Any) -> int:
        return keys["mem_kv"] * widths.kv_heads * (widths.qk_dim + widths.v_dim)

    def extras(self, attn: nn.Module, x: torch.Tensor, cache: Any) -> dict[str, Any]:
        """The memory keys and values (h, M, d), (h, M, dv), the keys normed as the tokens' are."""
        return {"mem": (attn.parts.norm_key(attn, attn.mem_k), attn.mem_v)}

    def scale_keys(self, attn: nn.Module, rows: torch.Tensor) -> None:
        """QK-clip: each memory key scaled as its head's keys, `rows` (h, d) per head and dim."""
        attn.mem_k.mul_(rows.to(attn.mem_k)[:, None, :])


PARTS = {"mem_kv": MemoryKV}
