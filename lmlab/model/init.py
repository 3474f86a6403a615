"""Weight initialisation schemes.

Contract: `init(model, *, <own params>)` re-initialises every weight of a GPT in place. Schemes read what
they need from the modules, through `lmlab.model.capabilities.marks`: `is_residual_proj` on the projections that
write into the residual stream, `fused` (the row blocks of a fused projection) and `value_parts` (which of them carry
values rather than queries or keys), and the block's `init_gain(n_layer)` (DeepNet's β under placement=deepnorm, 1
otherwise).
Norm weights keep their constructors' values (ones; ScaleNorm's sqrt(d)); biases are zeroed.

Every scheme also takes the keys of `conf/init_base/shared.yaml`, applied after its draw (`finish`): `zero_proj`
zeroes the projections that write into the stream (the GPT-2 speedrun's record 5: each block is the identity at step
0), `zero_head` the untied head (record 8), and `mimetic_vo=β` draws each attention layer's values and output as
W_v = √β·I + ε, W_o = −√β·I + ε, ε ~ N(0, `mimetic_noise`), so that W_o·W_v ≈ −β·I (Trockman & Kolter, 2023's
mimetic init of the value–output pair; the speedrun's record 64, β = 0.05, noise 0.01, with the MLP's down-projection
still zero under `zero_proj`).
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings

import torch
from torch import nn

from lmlab.model.capabilities import TokenMixer, marks
from lmlab.registry import NonNegativeFloat, PositiveFloat


def _linears_and_embeddings(model: nn.Module):
    """Each weight matrix once: a head tied to the embedding keeps the embedding's init."""
    seen = set()
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)) and id(module.weight) not in seen:
            seen.add(id(module.weight))
            yield module


def _zero_biases(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


@torch.no_grad()
def gpt2(model: nn.Module, *, std: PositiveFloat = 0.02) -> None:
    """GPT-2 (Radford et al., 2019): N(0, std) everywhere, residual projections scaled by 1/sqrt(N), N = the number
    of sublayers writing into the residual stream (2L for attention + FFN layers, L for GAU layers)."""
    _unhonoured_gain(model, "gpt2")
    n_writes = sum(len(block.sublayer_names) for block in model.h)
    for module in _linears_and_embeddings(model):
        scale = 1 / math.sqrt(n_writes) if marks(module).is_residual_proj else 1.0
        nn.init.normal_(module.weight, mean=0.0, std=std * scale)
    _zero_biases(model)


@torch.no_grad()
def small(model: nn.Module) -> None:
    """'Small init' (Nguyen & Salazar, 2019; GPT-NeoX): N(0, sqrt(2 / (5d))), and the residual projections
    N(0, 2 / (L·sqrt(d))) ('wang_init' in GPT-NeoX)."""
    _unhonoured_gain(model, "small")
    n_layer, d = len(model.h), model.wte.embedding_dim
    for module in _linears_and_embeddings(model):
        std = 2 / (n_layer * math.sqrt(d)) if marks(module).is_residual_proj else math.sqrt(2 / (5 * d))
        nn.init.normal_(module.weight, mean=0.0, std=std)
    _zero_biases(model)


def _xavier(weight: torch.Tensor, module: nn.Module, gain: float, parts: tuple[bool, ...] | None = None) -> None:
    """Xavier normal per matrix: a fused projection (QKV, GLU gate+up) is initialised as its separate parts (only
    those flagged in `parts`, when given)."""
    start = 0
    blocks = marks(module).fused or (weight.size(0),)
    for rows, chosen in zip(blocks, parts or (True,) * len(blocks)):
        if chosen:
            nn.init.xavier_normal_(weight[start:start + rows], gain=gain)
        start += rows


def _unhonoured_gain(model: nn.Module, init: str) -> None:
    """A placement whose method needs an init gain (DeepNorm's β) under an init that has no Xavier form to apply it
    to: say so, rather than silently training half of the method."""
    n_layer = len(model.h)
    beta = model.h[0].init_gain(n_layer)
    if beta != 1.0:
        warnings.warn(f"init={init} does not apply the placement's init gain β={beta:.4g} (DeepNet's value/output/FFN "
                      f"scaling under placement=deepnorm): use init=xavier or init=deepnet for the method as the "
                      f"paper describes it", stacklevel=3)


@torch.no_grad()
def _apply_block_gain(model: nn.Module, gain: float = 1.0) -> None:
    """Re-draw the value, output and FFN weights with Xavier gain β·gain, β = block.init_gain(L) (q and k keep
    `gain`). Found by markers: a residual projection, the `value_parts` of a fused projection (attention's v, GAU's
    u and v), and every other Linear of a sublayer that does not mix tokens (the FFN). Skipped where β = 1."""
    n_layer = len(model.h)
    for block in model.h:
        beta = block.init_gain(n_layer)
        if beta == 1.0:
            continue
        for name in block.sublayer_names:
            sub = getattr(block, name)
            for module in sub.modules():
                if isinstance(module, nn.Linear):
                    m = marks(module)
                    values = m.value_parts
                    if values is None:
                        values = (not isinstance(sub, TokenMixer),) * len(m.fused or (0,))
                    if m.is_residual_proj:
                        values = (True,) * len(values)
                    _xavier(module.weight, module, beta * gain, values)


@torch.no_grad()
def xavier(model: nn.Module, *, gain: PositiveFloat = 1.0) -> None:
    """Xavier/Glorot normal (Glorot & Bengio, 2010) for every matrix, the setting of Xiong et al. (2020), with the
    placement's init gain on the value, output and FFN weights (DeepNet's β under placement=deepnorm, so
    `placement=deepnorm init=xavier` is DeepNet as the paper describes it; 1 elsewhere).

    Embeddings get N(0, d^-1/2): unit-norm token vectors, like Xavier on a (V, d) matrix read one row at a time.
    """
    for module in _linears_and_embeddings(model):
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=module.embedding_dim ** -0.5)
        else:
            _xavier(module.weight, module, gain)
    _apply_block_gain(model, gain)
    _zero_biases(model)


@torch.no_grad()
def deepnet(model: nn.Module) -> None:
    """DeepNet (Wang et al., 2022): Xavier normal, with gain β = block.init_gain(L) on the value, output and
    FFN weights (q and k keep gain 1). β = (8L)^(-1/4) under placement=deepnorm, 1 elsewhere (then it is Xavier)."""
    xavier(model)


def _attention_vo(model: nn.Module) -> list[tuple[nn.Linear, nn.Linear]]:
    """Each attention layer's (fused q, k, v projection, output projection), found by their markers; refused unless
    the values and the output are as wide as the stream (the mimetic identity W_o·W_v = −β·I needs square maps)."""
    d = model.wte.embedding_dim
    pairs = []
    for block in model.h:
        for name in block.sublayer_names:
            sub = getattr(block, name)
            children = dict(sub.named_children())
            qkv, out = children.get("c_attn"), children.get("c_proj")
            if qkv is None or out is None or marks(qkv).value_parts != (False, False, True):
                continue
            if qkv.fused[2] != d or out.in_features != d:
                raise ValueError(f"init.mimetic_vo draws W_v and W_o as ±√β times the identity, which needs values "
                                 f"as wide as the stream: here {qkv.fused[2]} value and {out.in_features} output "
                                 f"columns against model.d_model={d}; use model.n_kv_head=model.n_head and "
                                 f"n_head × head_dim = d_model, or init.mimetic_vo=null")
            pairs.append((qkv, out))
    if not pairs:
        raise ValueError("init.mimetic_vo draws the value and output projections of softmax attention layers (q, k, v "
                         "fused, then an output projection: attention=mha and its head counts); this model has none; "
                         "use init.mimetic_vo=null")
    return pairs


@torch.no_grad()
def finish(model: nn.Module, *, zero_proj: bool = False, zero_head: bool = False,
           mimetic_vo: NonNegativeFloat | None = None, mimetic_noise: NonNegativeFloat = 0.01) -> None:
    """The shared keys, after a scheme's draw (the module docstring): zero the stream's projections, zero the head,
    then the mimetic value–output pairs (which replace a zeroed attention output)."""
    if zero_head:
        if model.lm_head.weight is model.wte.weight or model.cfg.untie_at_step is not None:
            raise ValueError("init.zero_head=true zeroes the head's own matrix; with model.tie_embeddings=true the "
                             "head reads the embedding (zero tokens) or, with model.untie_at_step, is copied from it: "
                             "set model.tie_embeddings=false, or init.zero_head=false")
        nn.init.zeros_(model.lm_head.weight)
    if zero_proj:
        for module in model.modules():
            if isinstance(module, nn.Linear) and marks(module).is_residual_proj:
                nn.init.zeros_(module.weight)
    if mimetic_vo is not None:
        root = mimetic_vo ** 0.5
        for qkv, out in _attention_vo(model):
            start = qkv.fused[0] + qkv.fused[1]
            v = qkv.weight[start:start + qkv.fused[2]]
            v.copy_(root * torch.eye(*v.shape) + mimetic_noise * torch.randn_like(v))
            out.weight.copy_(-root * torch.eye(*out.weight.shape) + mimetic_noise * torch.randn_like(out.weight))


_SHARED = [p for p in inspect.signature(finish).parameters.values() if p.kind is inspect.Parameter.KEYWORD_ONLY]


def _scheme(draw):
    """A scheme as the registry calls it: its own keys, then the shared ones (`finish`'s), in one signature."""
    @functools.wraps(draw)
    def init(model: nn.Module, **keys) -> None:
        shared = {p.name: keys.pop(p.name) for p in _SHARED if p.name in keys}
        draw(model, **keys)
        finish(model, **shared)

    own = inspect.signature(draw)
    init.__signature__ = own.replace(parameters=[*own.parameters.values(), *_SHARED])
    return init


INITS = {name: _scheme(draw) for name, draw in
         {"gpt2": gpt2, "deepnet": deepnet, "small": small, "xavier": xavier}.items()}
