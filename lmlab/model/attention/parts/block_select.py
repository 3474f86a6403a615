"""attention.select_blocks: content-sparse attention by top-k block selection (MoBA, Lu et al., 2025, "Mixture of
Block Attention for Long-Context LLMs"; the family of NSA's selection branch and DeepSeek's lightning indexer: a cheap
scorer picks the key blocks each query reads, attention runs on those).

The keys are cut into blocks of `select_block_size` tokens from position 0. Query q_t of head h scores each block
i that ends before its own by s_i = q_t · mean(K_i) (the block's mean key, its key/value head's under GQA/MQA), reads
its own block causally and the `select_blocks` − 1 past blocks of highest score (every past block while there are
fewer), and nothing else: at most select_blocks · select_block_size keys whatever the context's length. The gate has
no weights and passes no gradient (MoBA's); the selection is a mask beside the causal one and the documents' (a
block's keys outside the query's document stay unread). Softmax scores; its own selection of keys, so no window
(the KV cache keeps every key: a block's mean needs them)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.attention.parts import Part
from lmlab.registry import PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig


def select_blocks(q: torch.Tensor, k: torch.Tensor, offset: int, block: int, top_k: int,
                  docs: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Which keys each query reads: q (B, h, T, d) at positions offset..offset+T−1, k (B, hkv, S, d) the keys of
    positions 0..S−1 (S = offset + T) -> (B, h, T, S) bool: its own block's and its top-k − 1 past blocks'. `docs`
    (the queries' (B, T) and the keys' (B, S) document numbers): a block's mean is over the query's own document's
    keys (a block with none of them is not read), so another document's keys never steer the choice."""
    B, h, T, d = q.shape
    S = k.size(-2)
    n = -(-S // block)  # blocks, the last perhaps partial
    with torch.no_grad():
        keys = F.pad(k.float(), (0, 0, 0, n * block - S)).repeat_interleave(h // k.size(1), dim=1)  # (B, h, nb, d)
        if docs is None:
            counts = torch.full((n,), float(block), device=k.device)
            counts[-1] = S - (n - 1) * block
            means = keys.view(B, h, n, block, d).sum(-2) / counts[:, None]  # (B, h, n, d)
            scores = q.float() @ means.transpose(-2, -1)  # (B, h, T, n)
        else:  # q·mean(K) = mean(q·K), over the keys of the query's document
            same = F.pad(docs[0][:, :, None] == docs[1][:, None, :], (0, n * block - S)).view(B, 1, T, n, block)
            dots = (q.float() @ keys.transpose(-2, -1)).view(B, h, T, n, block)
            counts = same.sum(-1)  # (B, 1, T, n)
            scores = (dots * same).sum(-1) / counts.clamp_min(1)
            scores = scores.masked_fill(counts == 0, float("-inf"))
        own = torch.arange(offset, offset + T, device=q.device)[:, None] // block  # (T, 1)
        blocks = torch.arange(n, device=q.device)[None, :]
        scores = scores.masked_fill(blocks > own, float("-inf")).masked_fill(blocks == own, float("inf"))
        picked = scores.topk(min(top_k, n), dim=-1).indices
        chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, picked, True) & (scores > float("-inf"))
    return chosen.repeat_interleave(block, dim=-1)[..., :S]


class BlockSelect(Part):
    requires = {"score": (("softmax",), "the selection masks the keys of a softmax")}
    excludes = {**dict.fromkeys(("window", "pattern"), "the selection is its own sparse choice of keys, by content "
                                                       "rather than by distance; use one of the two"),
                "paired_heads": "a pair reads its two heads' slots, which blocks of tokens do not cut"}

    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, select_blocks: PositiveInt | None = None,
                 select_block_size: PositiveInt = 64) -> None:
        if select_blocks is None:
            raise ValueError(f"attention.select_block_size={select_block_size} is the size of the key blocks "
                             f"attention.select_blocks picks from: set attention.select_blocks (e.g. 4)")
        self.top_k, self.block = select_blocks, select_block_size

    def keys_read(self, attn: nn.Module, seq_len: int) -> int:
        return self.top_k * self.block

    def flops(self, attn: nn.Module, seq_len: int) -> int:
        """The gate's forward FLOPs per token: each query head against every block's mean key, q·mean(K), 2·d per
        block over the n_head heads, and the means, a sum of the context's keys (one add per key number)."""
        blocks = -(-seq_len // self.block)
        return 2 * attn.n_head * attn.qk_dim * blocks + attn.n_kv_head * attn.qk_dim

    def select(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, offset: int,
               docs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        if k.size(-2) != offset + q.size(-2):
            raise ValueError(f"attention.select_blocks reads every key from position 0; got {k.size(-2)} keys for "
                             f"queries at {offset}..{offset + q.size(-2) - 1}")
        return select_blocks(q, k, offset, self.block, self.top_k, docs)


PARTS = {"block_select": BlockSelect}
