"""attention.key_offset: the partial key offset of the GPT-2 speedrun's record 49 (2025-12-14, PR #169).

After the position scheme has rotated the keys, the dims it leaves unrotated (the "stationary" ones: under
`position.rotary_pct` < 1 the last (1 − rotary_pct) of each head's dims, where the record's half-truncated RoPE has
zero frequencies) are shifted one position forward: key t carries the stationary part of key t − 1 (the first token
keeps its own). A query can then match, through one key, a token by what came before it: an induction step inside one
layer. The rotated dims, the queries and the values are untouched. Through the KV cache the last token's unshifted
stationary part is kept for the next one (`LayerCache.inputs`); under attention.doc_mask a document's first token
keeps its own (nothing crosses a document's start), as the record's packed sequences do not need to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.model.attention.parts import Part

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import LayerCache
    from lmlab.model.position import Position

KEPT = "key_offset"  # LayerCache.inputs' entry: the last token's unshifted stationary key dims (B, nkv, 1, d_s)


def check_key_offset(position: dict) -> None:
    """Refuse a position scheme that leaves no dims unrotated, naming the keys."""
    if position.get("name") != "rope" or position.get("rotary_pct", 1.0) >= 1.0:
        raise ValueError(f"attention.key_offset=true shifts the keys' unrotated dims, and position="
                         f"{position.get('name')} rotary_pct={position.get('rotary_pct', 1.0)} leaves none: use "
                         f"position=rope with position.rotary_pct < 1 (the speedrun's half-truncated RoPE leaves "
                         f"half: 0.5), or attention.key_offset=false")


def shift_keys(k: torch.Tensor, start: int, offset: int, doc: torch.Tensor | None,
               cache: LayerCache | None) -> torch.Tensor:
    """k (B, nkv, T, hs) of positions offset..offset+T−1 with dims start: taken from the previous position's key;
    `doc` (B, offset + T): the documents, whose first tokens keep their own (None: no document mask)."""
    own = k[..., start:]
    prev = None if cache is None else cache.inputs.get(KEPT)
    first = own[..., :1, :] if prev is None else prev
    shifted = torch.cat((first, own[..., :-1, :]), dim=-2)
    if doc is not None:  # a document's first token: its own stationary dims
        here = doc[:, offset:]
        before = doc[:, offset - 1: offset + here.size(1) - 1] if offset else torch.cat((here[:, :1], here[:, :-1]), 1)
        opens = (here != before)[:, None, :, None]  # (B, 1, T, 1)
        shifted = torch.where(opens, own, shifted)
    if cache is not None:
        cache.inputs[KEPT] = own[..., -1:, :]
    return torch.cat((k[..., :start], shifted), dim=-1)


class KeyOffset(Part):
    rank = 7

    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, key_offset: bool = False) -> None:
        check_key_offset(cfg.position)

    def after_rotation(self, attn: nn.Module, k: torch.Tensor, pos: Position, offset: int, doc: torch.Tensor | None,
                       cache: LayerCache | None) -> torch.Tensor:
        return shift_keys(k, pos.rot_dim, offset, doc if attn.doc_mask else None, cache)


PARTS = {"key_offset": KeyOffset}
