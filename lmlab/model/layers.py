"""The layer plan: what each layer of the stack is, one frozen `Layer` record per layer, resolved once from every key
that makes a layer different from the others.

Eight keys in five groups say "layer i is different", and each stays the way to say it (old configs and saved runs
read the same): `mixer.pattern` (a layer's token mixer: attention, the recurrent mixer, or none), `attention.pattern`
and `attention.eval_window` (an attention layer's window), `attention.paired_heads` (its heads in pairs),
`ffn.skip_layers` (no FFN), `position.nope_layers` (no positions), `residual.scaled.unscaled_mixer` and
`residual.value_embed.layers` (its residual branches). `layer_plan(cfg)` turns them into records, each key checked
by its own rule, as before, with the same messages; what reads a layer's kind reads the record: the block builder
(lmlab.model.block), FLOPs, memory, the residual options, the monitor and interop.

    plan = layer_plan(model.cfg)          # or model.plan, the built model's
    plan[3].mixer, plan[3].window, plan[3].ffn   # e.g. 'gdn', None, True

The block kind builds from its plan (`kind.plan`): a transformer layer's comes from the keys above; a GAU's
(block=gau) is one attention-like unit per layer, no FFN. `layer_types(cfg)` (lmlab.model.mixer) is the plan's
`mixer` column alone, read before the sizes are resolved.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from lmlab.config import FFN_LAYERS
from lmlab.model.mask import layer_window
from lmlab.model.mixer import ATTENTION, NONE, layer_types
from lmlab.registry import check_values, option_defaults


class Layer(NamedTuple):
    """One layer of the stack (`index`, 0-based), as the keys resolve it. Frozen; a named tuple, which a stack of a
    million layers builds in a second (the size check reads the plan before it refuses such a model)."""

    index: int
    mixer: str  # its token mixer: `attention`, the recurrent mixer's name (gdn, mamba2, linear), or `none`
    window: int | None = None  # an attention layer's built window (attention.window/pattern); None: the whole context
    eval_window: int | None = None  # its window when not training (attention.eval_window; else `window`)
    paired_heads: bool = False  # attention.paired_heads: heads h and h + n_head/2 in one softmax
    ffn: bool = True  # False: ffn.skip_layers, no FFN (block=gau: never, the unit replaces it)
    nope: bool = False  # position.nope_layers: no positions (left unrotated among RoPE layers)
    unscaled_mixer: bool = False  # residual.scaled.unscaled_mixer: its token mixer's branch takes no alpha
    value_embed: int | None = None  # residual.value_embed: the table its attention values read (None: none)

    @property
    def attention(self) -> bool:
        """Whether its token mixer is softmax attention (the attention group's; block=gau: its unit)."""
        return self.mixer == ATTENTION

    @property
    def recurrent(self) -> bool:
        """Whether its token mixer is a recurrent mixer (the mixer group's: sublayer `mix`)."""
        return self.mixer not in (ATTENTION, NONE)

    @property
    def mixes_tokens(self) -> bool:
        """Whether it has a token mixer at all (mixer.pattern's `none`: its FFN alone)."""
        return self.mixer != NONE


def layer_plan(cfg: Any) -> tuple[Layer, ...]:
    """Each layer's record for the GPTConfig `cfg`, resolved (lmlab.model.resolve): the block kind's plan, whose
    `unused` groups say what its layers read (block=gau: neither the attention group nor an FFN, one unit each)."""
    unused = cfg.unused or ()
    mixers = layer_types(cfg)
    ffn = [False] * cfg.n_layer if "ffn" in unused else ffn_layers(cfg, mixers)
    return plan_layers(cfg, mixers, ffn, attention="attention" not in unused)


def ffn_layers(cfg: Any, mixers: Sequence[str]) -> list[bool]:
    """Whether each layer has its FFN: all but those `ffn.skip_layers` lists, checked (layers of the model; no layer
    left with neither a token mixer nor an FFN, which would be a layer fewer), naming the keys."""
    skip = cfg.ffn.get("skip_layers")
    check_values("ffn.", {"skip_layers": skip}, FFN_LAYERS)
    skip = sorted(set(skip or ()))
    if bad := [i for i in skip if i >= cfg.n_layer]:
        raise ValueError(f"ffn.skip_layers={skip} has {bad}, not layers of the model (0 .. model.n_layer - 1 = "
                         f"{cfg.n_layer - 1})")
    if empty := [i for i in skip if mixers[i] == NONE]:
        raise ValueError(f"ffn.skip_layers={skip} with mixer.pattern={cfg.mixer.get('pattern')} leaves layer "
                         f"{empty} with neither a token mixer nor an FFN: use a layer fewer (model.n_layer), or keep "
                         f"one of its sublayers")
    return [i not in skip for i in range(cfg.n_layer)]


_PLANS: dict[tuple, tuple[Layer, ...]] = {}  # the last plans made, by what they were made from (a model's blocks each
# build their kind, a check resolves a config more than once: one plan each time, not one per call)


def plan_layers(cfg: Any, mixers: Sequence[str], ffn: Sequence[bool], attention: bool = True) -> tuple[Layer, ...]:
    """The records of layers with these mixers and FFNs (the block kind's), the other keys read and checked here:
    windows and paired heads when the kind's attention layers read the attention group (`attention`), positions,
    and the residual options' layers."""
    key = (repr((cfg.n_layer, cfg.max_seq_len, cfg.n_head, cfg.kv_heads, cfg.attention, cfg.position,
                 cfg.rope_scaling, cfg.residual, cfg.mixer)), tuple(mixers), tuple(ffn), attention)
    if (plan := _PLANS.get(key)) is None:
        plan = _PLANS[key] = _plan_layers(cfg, mixers, ffn, attention)
        while len(_PLANS) > 8:
            del _PLANS[next(iter(_PLANS))]
    return plan


def _plan_layers(cfg: Any, mixers: Sequence[str], ffn: Sequence[bool], attention: bool) -> tuple[Layer, ...]:
    n = cfg.n_layer
    windows = eval_windows = paired = [None] * n
    if attention and ATTENTION in mixers:
        windows, eval_windows = _windows(cfg)
        paired = _paired(cfg, mixers)
    nope = _nope_layers(cfg)
    unscaled, tables = _residual_layers(cfg, mixers)
    return tuple(Layer(i, mixers[i],
                       window=windows[i] if mixers[i] == ATTENTION else None,
                       eval_window=eval_windows[i] if mixers[i] == ATTENTION else None,
                       paired_heads=bool(paired[i]) and mixers[i] == ATTENTION, ffn=bool(ffn[i]), nope=i in nope,
                       unscaled_mixer=i in unscaled, value_embed=tables.get(i)) for i in range(n))


def _windows(cfg: Any) -> tuple[list[int | None], list[int | None]]:
    """Every layer's built window (attention.window / pattern, lmlab.model.mask.layer_window) and its window when not
    training (attention.eval_window: the attention's own LayerWindows, checked there by key)."""
    attn = cfg.attention
    window, pattern = attn.get("window"), attn.get("pattern")
    built = [layer_window(window, pattern, i, cfg.n_layer, cfg.max_seq_len) for i in range(cfg.n_layer)]
    if attn.get("eval_window") is None:
        return built, built
    from lmlab.model.attention.parts.window import layer_windows  # the attention's own reading of the keys

    evals = [layer_windows(window, pattern, i, cfg.n_layer, cfg.max_seq_len, window_block=attn.get("window_block"),
                           window_schedule=attn.get("window_schedule"), eval_window=attn["eval_window"]
                           ).at(None, None, False) for i in range(cfg.n_layer)]
    return built, [None if w is None else int(w) for w in evals]


def _paired(cfg: Any, mixers: Sequence[str]) -> list[bool]:
    """attention.paired_heads per layer, checked by the part's own rule (parts/paired_heads.paired_layer; an option
    that refuses the key refuses it when built)."""
    paired_heads = cfg.attention.get("paired_heads", False)
    if paired_heads is False or paired_heads is None:
        return [False] * cfg.n_layer
    from lmlab.model.attention.parts.paired_heads import paired_layer

    return [m == ATTENTION and paired_layer(paired_heads, i, cfg) for i, m in enumerate(mixers)]


def _nope_layers(cfg: Any) -> frozenset[int]:
    """position.nope_layers, checked: layers of the model."""
    nope = frozenset(cfg.position.get("nope_layers") or ())
    if bad := sorted(i for i in nope if not 0 <= i < cfg.n_layer):
        raise ValueError(f"position.nope_layers has {bad}, not layers of the model (0 .. model.n_layer - 1 = "
                         f"{cfg.n_layer - 1})")
    return nope


def _residual_layers(cfg: Any, mixers: Sequence[str]) -> tuple[frozenset[int], dict[int, int]]:
    """residual.scaled.unscaled_mixer's layers and residual.value_embed's layer -> table, each checked by its
    option's own rule (lmlab.model.residual.scaled, value_embed)."""
    from lmlab.model.residual import RESIDUALS, residual_specs  # the residual options read the plan

    specs = {name: {**option_defaults(RESIDUALS[name]), **params}
             for name, params in residual_specs(cfg.residual or {})}
    unscaled: frozenset[int] = frozenset()
    tables: dict[int, int] = {}
    if "scaled" in specs:
        unscaled = frozenset(RESIDUALS["scaled"].unscaled_layers(cfg, specs["scaled"]["unscaled_mixer"], mixers))
    if "value_embed" in specs:
        spec = specs["value_embed"]
        tables = RESIDUALS["value_embed"].attending(cfg, spec["tables"], spec["layers"], mixers)
    return unscaled, tables


__all__ = ["Layer", "ffn_layers", "layer_plan", "plan_layers"]
