"""Causal self-attention and its key/value-head sharing options.

Contract: `Attention(cfg, *, score, qk_norm, logn_scaling, temperature)`; `forward(x, pos, cache=None)` maps
(B, T, C) -> (B, T, C), where `pos` is the model's Position (its `rotate` and `attn_bias` hooks) and `cache` this
layer's `LayerCache` when generating (the keys and values of the tokens before these T). The options differ only in
how many key/value heads they keep (`kv_heads`), which `GPTConfig` resolves once. `score` picks how logits become
weights (`lmlab.model.attention.score`).

The package: one file per option (`mha.py`: MHA, GQA and MQA, which differ only in their key/value head count;
`diff.py`; `mla.py`), each ending in its `OPTIONS`, which this registry gathers (a new variant is its file, its YAML
and its test); beside them what every option uses: `mask.py` (which keys a query reads, the banded O(T·W) path),
`flex.py` (the same masks through FlexAttention on the GPU), `score.py` (how logits become weights), `cache.py` (the
KV cache when generating).
"""

from __future__ import annotations

from torch import nn

from lmlab.model.attention.diff import DiffAttention
from lmlab.model.attention.mha import GQA, MHA, MQA, Geometry
from lmlab.model.attention.mla import MLA, MLA_SIZES, mla_sizes
from lmlab.model.attention.parts.gate import gate_width
from lmlab.registry import gather

ATTENTIONS: dict[str, type[MHA]] = gather(__name__, __path__, "OPTIONS")


def attention_sublayer(block: nn.Module) -> nn.Module | None:
    """The block's first sublayer with attention weights to show (`probs`), or None (the monitor's attention figures
    and eval's attention entropy read it)."""
    for attr in block.sublayer_names:
        module = getattr(block, attr)
        if hasattr(module, "probs"):
            return module
    return None


def distribution(attn: nn.Module) -> bool:
    """Whether each row of the sublayer's weights (`probs`, a sink's share appended) is a distribution: the
    sublayer says so (`sums_to_one`), else its score does."""
    return getattr(attn, "sums_to_one", attn.score.sums_to_one)

__all__ = ["ATTENTIONS", "DiffAttention", "GQA", "Geometry", "MHA", "MLA", "MLA_SIZES", "MQA", "attention_sublayer",
           "distribution", "gate_width", "mla_sizes"]
