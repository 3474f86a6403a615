"""Masked softmax attention through torch's FlexAttention (`torch.nn.attention.flex_attention`), on the GPU: the mask
is a function of (query, key) positions turned into a block mask (which blocks of 128 × 128 to compute at all), so a
window of W costs O(T·W) and documents cost their own blocks, with no (T, T) tensor; the attention-logit softcap is a
score modification inside the same kernel.

torch 2.13 has no FlexAttention backward on the CPU, so training on the CPU keeps lmlab's banded SDPA path
(lmlab.model.mask.banded_sdpa) and the explicit softcap; `use_flex` says where this path runs: CUDA tensors
(compiled
once per shape, as FlexAttention is meant to run; eager it would materialise the scores). The masks are the ones
`lmlab.model.mask.allowed` and `doc_allowed` build densely, and the tests check this path against them
(forward, on
the CPU without gradients).
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch

from lmlab.model.mask import granule

# Devices whose tensors take this path (tests add "cpu" to check the masks without gradients).
FLEX_DEVICES = {"cuda"}


def use_flex(q: torch.Tensor) -> bool:
    """Whether masked attention on `q` runs through FlexAttention here."""
    if q.device.type not in FLEX_DEVICES:
        return False
    return q.device.type == "cuda" or not (torch.is_grad_enabled() and q.requires_grad)


@functools.cache
def _kernel(device_type: str):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False) if device_type == "cuda" else flex_attention


# Block masks, built once (issue 60: each layer of each forward built its own, densely, 12.9-37.7x causal SDPA's time
# per FLOP on an H200). A mask that reads no data (a window, the causal mask under a softcap) depends only on its shape:
# kept across forwards in _SHAPED. One that reads the batch (documents) is built once per forward, in the forward's
# plan (`mask_plan`, opened by GPT.forward), and shared by every layer that uses it. A compiled graph builds its masks
# inside itself (no plan: the cache is host-side state the graph would not see change).
_PLANS: list[dict[Any, Any]] = []  # the open plans, innermost last (a forward inside a forward: generation's draft)
_SHAPED: collections.OrderedDict[Any, Any] = collections.OrderedDict()
_SHAPED_LIMIT = 64  # distinct data-free masks kept (lengths x windows x devices of a process)
BUILT = collections.Counter()  # block masks built ("block_masks"): what the tests count per forward


@contextlib.contextmanager
def mask_plan() -> Iterator[None]:
    """One forward's block masks: inside it, each distinct mask is built once and shared by the layers that use it."""
    _PLANS.append({})
    try:
        yield
    finally:
        _PLANS.pop()


def clear_masks() -> None:
    """Forget the masks kept across forwards (tests; a process that changed devices)."""
    _SHAPED.clear()


def _tensor_key(t: torch.Tensor | None) -> tuple | None:
    """A tensor's identity within one forward: its memory, shape and strides (views of one tensor share it)."""
    return None if t is None else (t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.device))


def _block_mask(key: tuple, build: Any, reads_data: bool) -> Any:
    """The block mask `key` names: kept, or `build()` once and kept (per shape, or in the open plan when it reads
    data); built every time while compiling or outside a plan when it reads data."""
    if torch.compiler.is_compiling():
        return build()
    store = _PLANS[-1] if reads_data and _PLANS else (None if reads_data else _SHAPED)
    if store is not None and key in store:
        if store is _SHAPED:
            _SHAPED.move_to_end(key)
        return store[key]
    mask = build()
    BUILT["block_masks"] += 1
    if store is not None:
        store[key] = mask
        if store is _SHAPED and len(_SHAPED) > _SHAPED_LIMIT:
            _SHAPED.popitem(last=False)
    return mask


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, offset: int,
                window: int | None = None, doc: tuple[torch.Tensor, torch.Tensor] | None = None,
                softcap: float | None = None, causal: bool = True) -> torch.Tensor:
    """softmax(softcap(q·kᵀ·scale), masked) v: q (B, h, T, d), k (B, hkv, S, d), v (B, hkv, S, dv), the S keys ending
    with the last query (at positions offset + T - S ..); query i reads key j when j's position is at most i's
    (`causal`; a bidirectional model: any key), within the `window` (counted in blocks when it is a `BlockWindow`: the
    record's block-causal sliding mask, whose blocks of 128 are FlexAttention's own), and (with `doc`, the queries'
    and keys' document numbers) of its document -> (B, h, T, dv)."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, _, T, _ = q.shape
    S = k.size(-2)
    first = offset + T - S  # the position of key 0
    q_doc, k_doc = doc if doc is not None else (None, None)
    g = granule(window)  # a window counted in blocks of g tokens (attention.window_block): whole blocks
    size = None if window is None else int(window)  # a plain int inside the traced mask

    def mask_mod(b, h, qi, kj):
        p, pk = qi + offset, kj + first
        keep = (pk <= p) if causal else (pk >= 0)
        if size is not None:
            keep = keep & ((p - pk < size) if g == 1 else (p // g - pk // g < size // g))
        if q_doc is not None:
            keep = keep & (q_doc[b, qi] == k_doc[b, kj])
        return keep

    score_mod = None
    if softcap is not None:
        def score_mod(score, b, h, qi, kj):
            return softcap * torch.tanh(score / softcap)

    key = (window, g, causal, T, S, offset, str(q.device), B if doc is not None else None, _tensor_key(q_doc),
           _tensor_key(k_doc))
    # built by a compiled graph on the GPU (FlexAttention's own advice: eager, create_block_mask evaluates mask_mod
    # on a dense (T, S) grid), except inside a compiled model, whose graph takes the build in
    compiled = q.device.type == "cuda" and not torch.compiler.is_compiling()
    block_mask = _block_mask(key, lambda: create_block_mask(mask_mod, B if doc is not None else None, None, T, S,
                                                            device=q.device, _compile=compiled),
                             reads_data=doc is not None)
    return _kernel(q.device.type)(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                  enable_gqa=q.size(1) != k.size(1))
