"""A GPT's FLOPs per token, shared by training's MFU (lmlab.run.perf), budgets, comparisons and the bench.

The model FLOPs count the matmuls only (Kaplan et al., 2020: 6·N per trained token), plus the attention scores and
their weighted sum, which have no weights.
"""

from __future__ import annotations

from torch import nn

from lmlab.model.mixer import MIXERS
from lmlab.registry import option_params

FLOPS_FORMULA = ("train 6*N + 6*L*T*w FLOPs/token, eval 2*N + 2*L*T*w (N = matmul weights a token uses, tied head "
                 "once, an MoE's top_k experts of n_experts; "
                 "w = the block's attention width: 2*d for a transformer layer, s + e for a GAU; head=mtp: its "
                 "blocks, and the output head once more per depth)")

def matmul_params(model: nn.Module) -> int:
    """N in 6·N: weights that take part in a matmul (Linear layers, the tied head once); lookups don't count. Of an
    MoE's stacked experts only the share one token multiplies (`active_share` = top_k / n_experts): active FLOPs."""
    return round(sum({id(m.weight): m.weight.numel() * getattr(m, "active_share", 1.0) for m in model.modules()
                      if isinstance(m, nn.Linear)}.values()))


def flops_per_token(model: nn.Module, seq_len: int) -> dict[str, int]:
    """Model FLOPs per token of a GPT at `seq_len`, for a train step (forward + backward) and an eval forward
    (FLOPS_FORMULA): the scores QKᵀ and the weighted sum A·V cost 2·T per unit of the block's own `attn_width`
    forward (a transformer layer: 2·n_head·head_dim, the usual 12·L·T·d in training; a GAU: s + e). A layer whose
    queries read a window of W keys (attention.window) costs W in place of T. A recurrent mixer's layer (mixer=gdn,
    mamba2, linear: sublayer `mix`) costs its own recurrence's FLOPs per token (its geometry's), whatever the length;
    a layer without a token mixer (mixer.pattern's `none`) costs no scores. Each layer's kind is the model's layer
    plan's (`model.plan`, lmlab.model.layers); the keys an attention layer reads, its own (`keys_read`, `extra_flops`:
    its window in force, a block selection's k·size keys and gate)."""
    cfg = model.cfg
    extra = list(getattr(model.head, "blocks", ()))  # head=mtp: a block per extra depth, the last layer's settings
    layers = [*zip(model.plan, model.h), *((model.plan[-1], block) for block in extra)]
    # an attention sublayer says what a query reads (its window, a block selection) and what its parts add (a
    # selection's gate); block=gau's unit (no attention group) reads the whole context
    unit = "attention" in (cfg.unused or ())
    attns = [] if unit else [block.attn for layer, block in layers if layer.attention]
    spans = [seq_len for layer, _ in layers if layer.attention] if unit else [a.keys_read(seq_len) for a in attns]
    n, mixing = matmul_params(model), 2 * sum(spans) * cfg.attn_width  # the mixing's forward FLOPs per token
    mixing += sum(a.extra_flops(seq_len) for a in attns)
    if mixers := sum(layer.recurrent for layer, _ in layers):
        name, params = option_params("mixer", MIXERS, cfg.mixer)
        per = MIXERS[name].geometry(cfg, **{k: v for k, v in params.items() if k != "pattern"}).flops_per_token
        mixing += mixers * per  # a mixer layer's forward FLOPs beyond its nn.Linear matmuls, once per layer
    n += model.head.depth * cfg.vocab_size * cfg.d_model  # each extra depth reads the shared output head again
    return {"train": 6 * n + 3 * mixing, "eval": 2 * n + mixing}  # training: forward + backward, 3 x the forward

