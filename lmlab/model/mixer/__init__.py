"""Token mixers chosen per layer (the `mixer` axis): softmax attention (the `attention` axis, whole) or a recurrent
mixer with a fixed-size state — Gated DeltaNet (`gdn`), Mamba-2 (`mamba2`), linear attention (`linear`) — in a
pattern over the layers, as the hybrid stacks of 2025–26 have them (Qwen3-Next's three GDN layers to one attention
layer, Nemotron-H's Mamba-2 with a few attention layers).

`mixer=<name>` gives every layer that mixer; `mixer.pattern` lists a layer type per layer, cycled over `model.n_layer`
(its length divides it): each entry the mixer's own name (or `mixer`, whichever mixer.name is: a sweep over mixers
with one pattern), `attention`, or `none`, e.g. `mixer=gdn mixer.pattern=[gdn,gdn,gdn,attention]`. Attention layers
take the whole `attention=` axis (windows, sinks, gates, MLA, ...); the mixer's layers take the mixer's own keys.
`mixer=attention` (the default) is the plain transformer.

A `none` layer has no token mixer at all (the GPT-2 speedrun's records 17 and 35: no attention in layer 7, then none
in layer 0 either), e.g. `mixer.pattern=[none,attention,attention,attention]` for 4 layers: the block is its FFN
alone (lmlab.model.block), with no mixer weights, no KV cache and no score FLOPs. Every layer `none` is refused (no
token would read another); so is a layer with no FFN either (`ffn.skip_layers`).

Contract of a mixer option (one file each, ending in its `OPTIONS`, gathered here): `Mixer(cfg, layer, *, pattern,
<own keys>)`, an nn.Module with `sublayer = "mix"` and `mixes_tokens = True`, called as `(x, pos=, cache=, doc=)`
like an attention (it reads no positions); `geometry(cfg, **keys)` a `MixerGeometry` from the sizes alone (its
weights, its generation state's numbers, its recurrence's FLOPs); with a `LayerCache` it continues from
`cache.state` and writes its new state there; `figures()` what the monitor shows of it (state norm, gate
statistics). It resets its state at document starts under `attention.doc_mask`. Shared pieces: `base.py`. Its
recurrence runs on lmlab's PyTorch form or a kernel package's (`mixer.backend`, chosen per device in `backend.py`);
`backend_used` names the path its last forward ran.
"""

from __future__ import annotations

from typing import Any

from lmlab.model.mixer.base import MixerGeometry
from lmlab.registry import gather

ATTENTION = "attention"  # the pattern entry that means a softmax attention layer (the attention axis)
NONE = "none"  # the pattern entry that means a layer without a token mixer (its FFN alone)
THE_MIXER = "mixer"  # the pattern entry that means mixer.name's layer, whichever it is


class Attention:
    """`mixer=attention`: every layer (or the pattern's `attention` entries) the attention axis's option."""

    def __init__(self, *, pattern: list[str] | None = None) -> None:
        self.pattern = pattern


MIXERS: dict[str, Any] = {ATTENTION: Attention, **gather(__name__, __path__, "OPTIONS")}


def layer_types(cfg: Any) -> list[str]:
    """Each layer's mixer name (`attention`, the mixer's, or `none`: no token mixer), from `cfg.mixer` (a GPTConfig):
    the pattern cycled over the layers; checked (the entries, the length dividing model.n_layer, some layer mixing
    tokens), naming the key. The `mixer` column of the layer plan (lmlab.model.layers, which builds each layer's
    record from it), read from the mixer keys alone, so it holds before the sizes are resolved: what a layer is
    beyond its mixer (window, FFN, positions, residual flags) is the plan's, `layer_plan`."""
    spec = dict(cfg.mixer)
    name, pattern = spec.get("name", ATTENTION), spec.get("pattern")
    if name not in MIXERS:
        raise ValueError(f"mixer={name!r} is not an option; choose one of {sorted(MIXERS)}")
    if pattern is None:
        return [name] * cfg.n_layer
    pattern = [name if p == THE_MIXER else p for p in pattern]
    accepted = sorted({name, ATTENTION})
    if not pattern or (bad := [p for p in pattern if p not in (*accepted, NONE)]):
        raise ValueError(f"mixer.pattern={pattern} has {bad if pattern else 'no entries'}: with mixer={name} each "
                         f"entry is one of {accepted}, {THE_MIXER} or {NONE} (a layer's type, {NONE}: no token mixer; "
                         f"the pattern is cycled over the layers)")
    if all(p == NONE for p in pattern):
        raise ValueError(f"mixer.pattern={pattern} gives no layer a token mixer, so no token would read another: keep "
                         f"{ATTENTION} (or the mixer) in some layer, e.g. mixer.pattern=[{NONE},{ATTENTION}]")
    if cfg.n_layer % len(pattern):
        divisors = [n for n in range(1, cfg.n_layer + 1) if cfg.n_layer % n == 0]
        raise ValueError(f"mixer.pattern has {len(pattern)} entries, which does not divide model.n_layer="
                         f"{cfg.n_layer}: the pattern is cycled over the layers; use a length among {divisors}")
    return [pattern[i % len(pattern)] for i in range(cfg.n_layer)]


__all__ = ["ATTENTION", "MIXERS", "NONE", "THE_MIXER", "MixerGeometry", "layer_types"]
