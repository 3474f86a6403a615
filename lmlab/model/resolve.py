"""The derived sizes of a GPTConfig, worked out once from the options' own rules (`lmlab.config.DERIVED`).

`resolve(cfg)` fills them in the record (which is then saved with them) and returns it: the attention option says
how many key/value heads it keeps, the FFN option how wide it is at the MLP's parameter count, the block kind the
attention geometry the position scheme is built for and what its KV cache holds. A RoPE scaling without its own
`original_max_len` scales relative to the trained length, which is written into the record too (a saved record
never holds `null` for a number the model used). A record that already carries derived sizes (one saved after
December 2026) is checked against them: they are the model its weights belong to.

`n_params_estimate(cfg)` counts the weights from the sizes alone (the residual options' tables included), for the
size bounds (`lmlab.model.memory`).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from lmlab.config import DERIVED, FFN_LAYERS, FFN_SIZES, OPTIONAL_GROUPS, GPTConfig
from lmlab.model.attention import ATTENTIONS
from lmlab.model.block import BLOCKS
from lmlab.model.capabilities import SizedAs
from lmlab.model.ffn import FFNS, matched_hidden
from lmlab.model.head import HEADS
from lmlab.model.init import INITS
from lmlab.model.mixer import ATTENTION, MIXERS, layer_types
from lmlab.model.position import POSITIONS
from lmlab.model.residual import RESIDUALS, residual_params, residual_specs
from lmlab.model.rope_scaling import ROPE_SCALINGS
from lmlab.registry import build, check_values, option_defaults, option_params


def resolve(cfg: GPTConfig) -> GPTConfig:
    """`cfg` with its derived sizes filled (in place; resolving twice changes nothing); returns it. The groups the
    block kind does not read (its `uses`) are recorded in `unused`, not validated, and size nothing (0)."""
    block_name, _ = option_params("block", BLOCKS, cfg.block)
    uses = BLOCKS[block_name].uses
    derived: dict[str, Any] = {"head_dim": cfg.d_model // cfg.n_head,
                               "unused": [g for g in OPTIONAL_GROUPS if g not in uses]}
    # Every key of these options in the record: one saved before a key existed holds its default (the same model).
    if "attention" in uses:
        attn_name, _ = option_params("attention", ATTENTIONS, cfg.attention)
        cfg.attention = {**option_defaults(ATTENTIONS[attn_name]), **cfg.attention}
    pos_name, _ = option_params("position", POSITIONS, cfg.position)
    cfg.position = {**option_defaults(POSITIONS[pos_name]), **cfg.position}
    cfg.residual = {name: {**option_defaults(RESIDUALS[name]), **params}
                    for name, params in residual_specs(cfg.residual)}
    mixer_name, _ = option_params("mixer", MIXERS, cfg.mixer)
    cfg.mixer = {**option_defaults(MIXERS[mixer_name]), **cfg.mixer}
    cfg.ffn = {**dict.fromkeys(FFN_LAYERS), **cfg.ffn}  # ffn.skip_layers: null (every layer its FFN) when not saved
    init_name, _ = option_params("init", INITS, cfg.init)  # the shared init keys (zero_proj, mimetic_vo, ...)
    cfg.init = {**option_defaults(INITS[init_name]), **cfg.init}
    head_name, _ = option_params("head", HEADS, cfg.head)  # head=prefix's fade, ...
    cfg.head = {**option_defaults(HEADS[head_name]), **cfg.head}
    if cfg.logit_softcap is None and (cfg.logit_softcap_width is not None or cfg.logit_softcap_offset):
        shown = (f"model.logit_softcap_width={cfg.logit_softcap_width}" if cfg.logit_softcap_width is not None
                 else f"model.logit_softcap_offset={cfg.logit_softcap_offset}")
        raise ValueError(f"{shown} shapes the final-logit softcap, which is off (model.logit_softcap=null); set "
                         f"model.logit_softcap (the speedrun's logit rescale: 11.5, width 15, offset 5) or leave it")
    if "attention" in uses:
        _check_attention_layers(cfg)
    else:
        _check_no_attention(cfg, block_name)
    derived["kv_heads"] = _kv_heads(cfg) if "attention" in uses else 0
    derived["ffn_hidden"] = _ffn_hidden(cfg) if "ffn" in uses else 0
    for name, value in derived.items():
        _fill(cfg, name, value)
    if "attention" in uses:  # the sizes the option derives from the ones above (MLA's), in the record as numbers
        cfg.attention = ATTENTIONS[attn_name].fill(cfg, cfg.attention)

    kind = build("block", BLOCKS, cfg.block, cfg)  # reads the sizes above
    for name, value in (("attn_heads", kind.heads), ("attn_head_dim", kind.head_dim),
                        ("cache_width", kind.cache_width), ("attn_width", kind.attn_width)):
        _fill(cfg, name, value)

    scaling, _ = option_params("rope_scaling", ROPE_SCALINGS, cfg.rope_scaling)
    if scaling != "none" and cfg.rope_scaling.get("original_max_len") is None:
        cfg.rope_scaling = {**cfg.rope_scaling, "original_max_len": cfg.train_len}
    assert cfg.resolved, [n for n in DERIVED if getattr(cfg, n) is None]
    return cfg


def _check_attention_layers(cfg: GPTConfig) -> None:
    """A stack without attention layers (mixer=gdn, no `attention` in mixer.pattern) takes no attention keys but
    doc_mask (which resets the mixers' states at document starts): any other is refused by key, never ignored."""
    if ATTENTION in layer_types(cfg):
        return
    defaults = {**option_defaults(ATTENTIONS["mha"]), "name": "mha", "doc_mask": cfg.attention.get("doc_mask")}
    if changed := sorted(k for k, v in cfg.attention.items() if defaults.get(k, object()) != v):
        shown = " ".join(f"attention.{k}={cfg.attention[k]}" if k != "name" else f"attention={cfg.attention[k]}"
                         for k in changed)
        raise ValueError(f"{shown}: mixer={cfg.mixer['name']} has no attention layer for it (mixer.pattern="
                         f"{cfg.mixer.get('pattern')}); add attention to mixer.pattern (e.g. [{cfg.mixer['name']},"
                         f"attention]) or leave the attention keys at their defaults")


def _check_no_attention(cfg: GPTConfig, block: str) -> None:
    """A block kind without an attention sublayer (block=gau: one unit per layer) does not read the attention group:
    the option (mha, gqa, ...) is a transformer's and is recorded as unused, but a behaviour every attention option
    takes (a document mask, a window, a softcap, sinks, a gate, q/k norms: conf/attention_base/shared.yaml) set away
    from its default would be expected of the unit's attention too and do nothing, so it is refused by key."""
    shared = option_defaults(ATTENTIONS["mha"])  # MHA takes exactly the shared keys
    if changed := sorted(k for k, v in shared.items() if cfg.attention.get(k, v) != v):
        shown = " ".join(f"attention.{k}={cfg.attention[k]}" for k in changed)
        raise ValueError(f"{shown}: block={block} has no attention sublayer for it (one unit per layer, with its own "
                         f"keys: block.*); use block=transformer, or leave the attention keys at their defaults")


def _kv_heads(cfg: GPTConfig) -> int:
    """The key/value heads the attention option keeps (MHA: n_head; GQA: model.n_kv_head; MQA: 1)."""
    attn_name, _ = option_params("attention", ATTENTIONS, cfg.attention)
    kv = ATTENTIONS[attn_name].kv_heads(cfg.n_head, cfg.n_kv_head)
    if kv < 1 or cfg.n_head % kv:
        divisors = [h for h in range(1, cfg.n_head + 1) if cfg.n_head % h == 0]
        raise ValueError(f"model.n_kv_head={kv} must divide model.n_head={cfg.n_head} (attention={attn_name}); "
                         f"choose among {divisors}")
    return kv


def _ffn_hidden(cfg: GPTConfig) -> int:
    """The FFN's hidden size: the MLP's is hidden_mult · d_model rounded to multiple_of; every option is sized to the
    MLP's parameter count within 1% (lmlab.model.ffn.matched_hidden), unless ffn.hidden sets it; an MoE's experts each
    as a dense FFN of their kind would be (`sized_as`)."""
    check_values("ffn.", cfg.ffn, FFN_SIZES)  # hidden_mult=0 would otherwise round up to one multiple_of
    ffn_name, params = option_params("ffn", FFNS, cfg.ffn_spec)
    multiple_of = cfg.ffn.get("multiple_of", 64)
    mlp_hidden = max(multiple_of, multiple_of * round(cfg.ffn.get("hidden_mult", 4) * cfg.d_model / multiple_of))
    ffn = FFNS[ffn_name]
    sized = ffn.sized_as(params) if isinstance(ffn, SizedAs) else ffn  # an MoE: each expert as a dense FFN of its kind
    return cfg.ffn.get("hidden") or matched_hidden(sized, cfg.d_model, mlp_hidden, cfg.bias, multiple_of)


def _fill(cfg: GPTConfig, name: str, value: Any) -> None:
    saved = getattr(cfg, name)
    if saved is not None and saved != value:
        raise ValueError(f"model.{name}={saved} in the record, but its sizes and options give {value}: the record "
                         f"was changed after it was resolved (change the options, not the derived sizes)")
    setattr(cfg, name, value)


def n_params_estimate(cfg: GPTConfig) -> int:
    """Weights from the sizes alone: the blocks' (each kind's `n_params`), the embeddings' and a learned position
    table's (norms and gains aside: a lower bound within 1% of the built model's count)."""
    kind = build("block", BLOCKS, cfg.block, resolve(cfg))
    head, params = option_params("head", HEADS, cfg.head)
    untied = not cfg.tie_embeddings or cfg.untie_at_step is not None  # model.untie_at_step: a head matrix of its own
    layouts = list(zip(kind.types, kind.ffn_layers))  # each layer's mixer and whether it has its FFN
    layers = sum(kind.n_params(layouts.index(t)) * n for t, n in Counter(layouts).items())  # per layout
    return (layers + cfg.vocab_size * cfg.d_model * (2 if untied else 1)
            + residual_params(cfg) + HEADS[head].n_params(cfg, **params)
            + POSITIONS[option_params("position", POSITIONS, cfg.position)[0]].n_params(cfg.d_model, cfg.max_seq_len))
