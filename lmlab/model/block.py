"""What a layer is made of (the `block` axis): named sublayers, each wired into the residual stream by the
`placement` group (`x + F(N(x))`, `N(x + F(x))`, ... applied per sublayer).

Contract: `Kind(cfg, *, <own params>)` with `heads` and `head_dim`, the attention geometry the position scheme is built
for (RoPE's rotated size, ALiBi's slopes), `sublayers(layer)`, the modules of layer `layer` in order, by attribute name,
and `n_params(layer)`, a layer's weights from the sizes alone (what a size bound reads before anything is built),
`plan`, each layer's record (lmlab.model.layers: its token mixer, window, FFN or none, positions, residual flags),
and its columns `types` and `ffn_layers`, each layer's token mixer and whether it has an FFN (layers alike in both
count alike), and `cache_width`, the numbers a layer's KV cache holds per token (keys and values), and `attn_width`,
the widths its scores read (queries/keys) plus the width they weigh (values): what the attention's FLOPs per token
follow. `uses` names the optional groups the kind reads (`attention`, `ffn`): the others are recorded as unused, not
validated. A sublayer says on itself what shared code needs: `sublayer` (its name in the monitor's figures),
`mixes_tokens` (called as `(x, pos, cache)`; `probs(x, pos)` gives its attention weights), and on its projections the
init markers (`is_residual_proj`, `value_parts`, read by `lmlab.model.init`).

A layer may lack a sublayer (the transformer's): it is then absent with its norm(s), so under every placement the
stream passes that step unchanged (pre: x + F(N(x)) becomes x; post: N(x + F(x)) becomes x, not renormalised there;
deepnorm: N(αx + F(x)) becomes x, no α either), and the block's sublayers left are numbered from 1 (`ln_1` is the
FFN's norm in a layer without a token mixer).
"""

from __future__ import annotations

from typing import Literal

from torch import nn

from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS
from lmlab.model.ffn import FFNS
from lmlab.model.gau import GAU
from lmlab.model.layers import ffn_layers, plan_layers
from lmlab.model.mixer import ATTENTION, MIXERS, NONE, layer_types
from lmlab.registry import PositiveFloat, PositiveInt, build, option_params


class Transformer:
    """The transformer layer (Vaswani et al., 2017): a token mixer, then the FFN (`ffn`). The mixer of each layer comes
    from the `mixer` group's pattern (lmlab.model.mixer): softmax attention (the `attention` group, sublayer `attn`)
    or a recurrent mixer (sublayer `mix`: Gated DeltaNet, Mamba-2, linear attention), or none (a `none` entry). The
    attention geometry is that of the attention layers (what positions, caches and FLOPs of those layers follow);
    `plan` holds each layer's record (lmlab.model.layers), `types` its mixer, `ffn_layers` whether it has its FFN:
    all but `ffn.skip_layers` (the GPT-2 speedrun's record 30 dropped the first layer's MLP, records 17 and 35 the
    attention of layers 7 and 0). A layer without a sublayer has none of its weights, FLOPs or KV cache."""

    uses = ("attention", "ffn")

    def __init__(self, cfg: GPTConfig) -> None:
        self.cfg = cfg
        name, params = option_params("attention", ATTENTIONS, cfg.attention)
        self.attention = ATTENTIONS[name].geometry(cfg, **params)  # the option's own heads, cache and weights
        self.heads, self.head_dim = self.attention.heads, self.attention.head_dim
        self.cache_width = self.attention.cache_width
        self.attn_width = self.attention.attn_width  # MHA: QKᵀ over n_head heads of head_dim, then A·V as wide
        mixers = layer_types(cfg)
        self.plan = plan_layers(cfg, mixers, ffn_layers(cfg, mixers))  # each layer's record (lmlab.model.layers)
        self.types = [layer.mixer for layer in self.plan]  # the plan's columns, as the size counts read them
        self.ffn_layers = [layer.ffn for layer in self.plan]
        self.mixer = None  # the recurrent mixer's geometry, when some layer has one
        if any(layer.recurrent for layer in self.plan):
            mixer, params = option_params("mixer", MIXERS, cfg.mixer)
            self.mixer = MIXERS[mixer].geometry(cfg, **{k: v for k, v in params.items() if k != "pattern"})

    def n_params(self, layer: int = 0) -> int:
        """Layer `layer`'s weights: its mixer's (the attention option's `geometry`, the recurrent mixer's, or 0 for
        `none`), plus the FFN's (its option's count) unless the layer is in ffn.skip_layers."""
        cfg, here = self.cfg, self.plan[layer]
        mix = 0 if not here.mixes_tokens else self.attention.n_params if here.attention else self.mixer.n_params
        if not here.ffn:
            return mix
        ffn, params = option_params("ffn", FFNS, cfg.ffn_spec)  # an MoE's count reads its own options
        return mix + FFNS[ffn].n_params(cfg.d_model, cfg.ffn_hidden, cfg.bias, **params)

    def sublayers(self, layer: int = 0) -> dict[str, nn.Module]:
        cfg, here, out = self.cfg, self.plan[layer], {}
        if here.attention:
            out["attn"] = build("attention", ATTENTIONS, cfg.attention, cfg, layer)
        elif here.recurrent:
            out["mix"] = build("mixer", MIXERS, cfg.mixer, cfg, layer)
        if here.ffn:
            out["mlp"] = build("ffn", FFNS, cfg.ffn_spec, cfg.d_model, cfg.ffn_hidden, activation=cfg.activation,
                               bias=cfg.bias)
        return out


class GAUBlock:
    """One Gated Attention Unit per layer (FLASH, Hua et al., 2022; `lmlab.model.gau`), replacing attention + FFN:
    key size `s`, expansion e = `expansion` · d_model, attention weights from `score`. The default score is GAU-α's
    softmax_plus (Su, 2022, the source note): FLASH's relu²/n generalised poorly to other lengths in Su's tests.
    One layer has d·s + 3·d·e + 4s parameters, about half an attention + FFN pair (12d²) at FLASH's sizes (s ≪ d):
    match a transformer's size with about twice the layers (conf/model/tiny_gau.yaml). `qk_init`: the Q/K scale γ
    at 1 (`ones`) or from N(0, 0.02) (`flash`, FLASH's code; lmlab.model.gau)."""

    uses = ()  # one unit instead of attention + FFN: the attention and ffn groups do not apply

    def __init__(self, cfg: GPTConfig, *, s: PositiveInt = 128, expansion: PositiveFloat = 2.0,
                 score: str = "softmax_plus", qk_init: Literal["ones", "flash"] = "ones") -> None:
        self.cfg, self.s, self.score, self.qk_init = cfg, s, score, qk_init
        if (mixer := cfg.mixer.get("name", ATTENTION)) != ATTENTION:
            raise ValueError(f"mixer={mixer} chooses each transformer layer's token mixer; block=gau has one unit per "
                             f"layer in its place: use block=transformer, or mixer=attention")
        if NONE in (pattern := cfg.mixer.get("pattern") or ()) or cfg.ffn.get("skip_layers"):
            shown = f"mixer.pattern={pattern}" if NONE in pattern else f"ffn.skip_layers={cfg.ffn['skip_layers']}"
            raise ValueError(f"{shown} drops a transformer layer's sublayer; block=gau has one unit per layer, "
                             f"nothing to drop: use block=transformer, or leave it out")
        self.types = [ATTENTION] * cfg.n_layer  # each layer's unit: attention-like (its KV cache, its scores)
        self.ffn_layers = [False] * cfg.n_layer  # one unit, no FFN
        self.plan = plan_layers(cfg, self.types, self.ffn_layers, attention=False)  # no attention group keys
        self.e = max(1, round(expansion * cfg.d_model))
        self.heads, self.head_dim = 1, s
        self.cache_width = s + self.e  # one head: keys of size s, values of size e
        self.attn_width = s + self.e  # QKᵀ of key size s, then A·V of width e (= 2·d at FLASH's expansion)

    def n_params(self, layer: int = 0) -> int:
        d, e, s = self.cfg.d_model, self.e, self.s
        return d * (2 * e + s) + e * d + 4 * s + self.cfg.bias * (2 * e + s + d)

    def sublayers(self, layer: int = 0) -> dict[str, nn.Module]:
        cfg = self.cfg
        return {"gau": GAU(cfg.d_model, self.s, self.e, score=self.score, activation=cfg.activation, bias=cfg.bias,
                           train_len=cfg.train_len, dropout=cfg.dropout, qk_init=self.qk_init)}


BLOCKS = {"transformer": Transformer, "gau": GAUBlock}
