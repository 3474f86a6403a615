"""CoPE: positions counted by gates on the keys, as a bias on the logits."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any

import torch
from torch import nn

from lmlab.model.mask import allowed
from lmlab.model.position.base import Position
from lmlab.registry import Range


class CoPE(Position):
    """Contextual position encoding (Golovneva et al., 2024, "Contextual Position Encoding: Learning to Count What's
    Important"). Query i gates every key j <= i, g_ij = σ(q_i·k_j·scale), and key j sits at the fractional position
    p_ij = Σ_{t=j..i} g_it, the keys from j to i (both counted) that query i counts: all gates 1 give p_ij = i − j + 1.
    The logit gains z_i[p_ij], z_i[p] = q_i·e[p] at the integer positions p = 0 .. npos_max − 1, linearly interpolated
    between ⌊p⌋ and ⌈p⌉, p clamped at npos_max − 1; e[p] is learned, of the head's size, shared by the heads.

    As the paper's code (its appendix; facebookresearch/RAM, projects/cope): the gates read the layer's own logits, q·k
    times the attention's scale (1/√d; attention.temperature too); the future keys' gates are zeroed before the sum
    (the paper's mask), so p_ij sums the keys j .. i only; the position logits are computed at the integer positions,
    then interpolated; e starts at zero (no init scheme touches it: a plain parameter). The bias is added after the
    scale, as the appendix's listing adds it (the repository's default divides it by √d too: the same model with e √d
    times larger). A window or a document is a stretch of keys that ends at the query, so every key between a key it
    reads and itself is read too: the count stays inside it with no other mask before the sum (a packed document
    counts as if alone), and a KV cache's keys, a windowed layer's last W − 1 included, give the full forward's bias.

    Departures: one table for every layer (the hook has no layer: the repository's `--cope-shared`; its default
    learns one per layer); the table, a 2-D weight that is no Linear's, is decayed (optimizer role `other`). z reads
    the query's last head_dim numbers, the size the scheme is built for: a whole head, MLA's rotary part."""

    logit_bias = "position=cope adds a learned bias of the gated key count to every logit"

    causal_only = ("position=cope counts the gated keys between a past key and its query (Golovneva et al., 2024), "
                   "which has no form for the keys after a query; use position=rope, alibi or t5")

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, npos_max: Annotated[int, Range(ge=2)] = 64) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.npos_max, self.head_dim = npos_max, head_dim
        self.pos_emb = nn.Parameter(torch.zeros(head_dim, npos_max))  # e[p], column p

    @classmethod
    def attention_bytes(cls, n_head: int, T: int, batch: int) -> int:
        # score_bias's (B, nh, T, T) fp32 logits, gates, flipped copies and sums, positions, floor, weight, two int64
        # indices, two gathered logits and the bias, not all held at once, then SDPA's math path with the bias as its
        # mask, as under ALiBi: 72 bytes an entry (measured on CPU, nh=4, T=2048, one sequence, forward and backward:
        # 1094 MB peak, estimate 1208 MB; 620 MB without gradients). The table itself is left out.
        return 72 * batch * n_head * T * T

    def score_bias(self, q: torch.Tensor, k: torch.Tensor, scale: float, offset: int = 0) -> torch.Tensor:
        T, S, dtype = q.size(-2), k.size(-2), q.dtype
        past = allowed(T, offset, S, None, q.device)  # (T, S): key j at or before query i
        f32 = torch.promote_types(dtype, torch.float32)  # counted in fp32 at least (bf16 holds integers to 256)
        logits = (q @ k.repeat_interleave(q.size(1) // k.size(1), dim=1).transpose(-2, -1)).to(f32) * scale
        gates = torch.sigmoid(logits).masked_fill(~past, 0.0)  # g_ij, 0 past the query
        p = gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.npos_max - 1)  # p_ij = Σ_{t=j..i} g_it
        z = (q[..., -self.head_dim:] @ self.pos_emb.to(dtype)).to(f32)  # (B, nh, T, npos_max): z_i[p] = q_i·e[p]
        floor = p.floor()
        w = p - floor  # the gates' gradient: ⌊p⌋ and ⌈p⌉ have none
        bias = w * z.gather(-1, p.ceil().long()) + (1 - w) * z.gather(-1, floor.long())
        return bias.masked_fill(~past, float("-inf")).to(dtype)


OPTIONS = {"cope": CoPE}
