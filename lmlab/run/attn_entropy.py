"""Attention entropy at an evaluated length: the quantity YaRN's temperature is there for.

The source note's motivation for YaRN's attention factor: past the trained length a query reads more keys, its
softmax spreads (entropy ~ log n for flat logits), and interpolating the frequencies flattens the logits further;
the factor √(1/t) = 0.1·ln(s) + 1 on cos and sin scales the logits by its square and pulls the entropy back.
`attention_entropy` is the mean over layers, heads and queries of −Σ p log p of the attention weights of one forward
over the windows (the sublayers' own `probs`, as the monitor's attn/entropy), for scores whose rows are
distributions (None otherwise: relu²/n rows are not). A dynamic scaling is measured at the full length (the scaling
of the window's last position), not block by block as its loss is scored.
"""

from __future__ import annotations

import torch
from torch import nn

from lmlab.model.attention import attention_sublayer, distribution


@torch.no_grad()
def attention_entropy(model: nn.Module, windows: torch.Tensor) -> float | None:
    """Mean attention entropy (nats) of `model` over `windows` (n, T + 1): the inputs are windows[:, :-1]."""
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor | None]] = {}
    hooks = []
    for i, block in enumerate(model.h):
        attn = attention_sublayer(block)
        if attn is not None and distribution(attn):
            def keep(module, args, kwargs, i=i):
                inputs[i] = (args[0], kwargs.get("doc"))
            hooks.append(attn.register_forward_pre_hook(keep, with_kwargs=True))
    if not hooks:
        return None
    try:
        model.eval()
        model(windows[:, :-1])
    finally:
        for h in hooks:
            h.remove()
    total, count = 0.0, 0
    for i, (x, doc) in sorted(inputs.items()):
        attn = attention_sublayer(model.h[i])
        p, _ = attn.probs(x, model.pos, doc)  # (B, nh, T, T)
        if attn.sink_share:  # a row and its sink's share make the distribution
            p = torch.cat((p, (1 - p.sum(-1, keepdim=True)).clamp_min(0)), dim=-1)
        entropy = -(p * p.clamp_min(1e-30).log()).sum(-1)  # (B, nh, T)
        total, count = total + float(entropy.double().sum()), count + entropy.numel()
    return total / count
