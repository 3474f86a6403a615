"""Weight initialisation schemes.

Contract: `init(model, *, <own params>)` re-initialises every weight of a GPT in place. Schemes read what
they need from the modules: `is_residual_proj` on the projections that write into the residual stream,
`fused` (the row blocks of a fused projection) and `value_parts` (which of them carry values rather than queries or
keys), and the block's `init_gain(n_layer)` (DeepNet's β under placement=deepnorm, 1 otherwise).
Norm weights keep their constructors' values (ones; ScaleNorm's sqrt(d)); biases are zeroed.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import nn

from lmlab.registry import PositiveFloat


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
        scale = 1 / math.sqrt(n_writes) if getattr(module, "is_residual_proj", False) else 1.0
        nn.init.normal_(module.weight, mean=0.0, std=std * scale)
    _zero_biases(model)


@torch.no_grad()
def small(model: nn.Module) -> None:
    """'Small init' (Nguyen & Salazar, 2019; GPT-NeoX): N(0, sqrt(2 / (5d))), and the residual projections
    N(0, 2 / (L·sqrt(d))) ('wang_init' in GPT-NeoX)."""
    _unhonoured_gain(model, "small")
    n_layer, d = len(model.h), model.wte.embedding_dim
    for module in _linears_and_embeddings(model):
        std = 2 / (n_layer * math.sqrt(d)) if getattr(module, "is_residual_proj", False) else math.sqrt(2 / (5 * d))
        nn.init.normal_(module.weight, mean=0.0, std=std)
    _zero_biases(model)


def _xavier(weight: torch.Tensor, module: nn.Module, gain: float, parts: tuple[bool, ...] | None = None) -> None:
    """Xavier normal per matrix: a fused projection (QKV, GLU gate+up) is initialised as its separate parts (only
    those flagged in `parts`, when given)."""
    start = 0
    blocks = getattr(module, "fused", (weight.size(0),))
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
                    values = getattr(module, "value_parts", None)
                    if values is None:
                        values = (not getattr(sub, "mixes_tokens", False),) * len(getattr(module, "fused", (0,)))
                    if getattr(module, "is_residual_proj", False):
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


INITS = {"gpt2": gpt2, "deepnet": deepnet, "small": small, "xavier": xavier}
