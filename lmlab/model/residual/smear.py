"""`residual=smear`: a gated one-token look-back on the token embeddings (the GPT-2 speedrun's smear, record 34,
2025-09-18, @classiclarryd: "smear token embeddings 1 position forward"):

    x_t ← x_t + λ·σ(w · x_t[:g])·x_{t−1}        (w ∈ R^g, g = `gate_channels`; λ a learned scalar, init `init`)

on the embeddings before the embedding norm, so the stream and `residual=x0`'s x0 carry the smeared ones, as in the
record (`x = x0 = norm(smear(embed(idx)))`). The gate reads the first g channels of the token's own embedding (the
record's `smear_gate = Linear(12, 1)` on `x[1:, :12]`); x_{t−1} is the previous token's embedding before its own
smear; the text's first token gets nothing. w starts at zero (σ = 1/2, the record's). The record's λ starts at 0;
lmlab's default is 0.1 (λ·σ = 0.05, near the 0.07 the record's README reports learned), because with λ = 0 the gate
gets no gradient at step 0 — `residual.smear.init=0` is the record's model at step 0. w and λ are vectors and
scalars: AdamW's no-decay group under every optimizer (the speedrun's later records also train the gate with Adam,
without decay; record 34 itself gave the (1, 12) gate to Muon).

Documents: the record smears over its packed batch, a document's first token reading the last one of the document
before. Under attention.doc_mask lmlab cuts at each document start instead (the first token of a document gets
nothing), so a packed document reads as it would alone, as every other part does under doc_mask. When generating,
the KV cache keeps the last token's embedding (`cache.layers[0].inputs["smear"]`) for the next forward's first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.registry import PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import KVCache


def look_back(t: torch.Tensor, cache: KVCache | None, name: str, doc: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """t (B, T, ...) of this forward's tokens -> (t_{s−1} at each position s: the cached forward's last in front when
    generating, zeros before the text; whether s has a previous token: (B, T) bool, false at the text's first token
    and, given `doc` (B, offset + T), at each document's first). Keeps t's last in the cache under `name`."""
    B, T = t.shape[:2]
    offset = 0 if cache is None else cache.length
    past = None if cache is None else cache.layers[0].inputs.get(name)
    if cache is not None:
        cache.layers[0].inputs[name] = t[:, -1:].clone()
    prev = torch.cat((torch.zeros_like(t[:, :1]) if past is None else past, t[:, :-1]), dim=1)
    if doc is None:
        has = (torch.arange(offset, offset + T, device=t.device) > 0).expand(B, T)
    else:  # the same document as the position before (−1: before the text)
        has = F.pad(doc, (1, 0), value=-1)[:, offset:offset + T] == doc[:, offset:offset + T]
    return prev, has


class Smear(nn.Module):
    def __init__(self, cfg: GPTConfig, *, gate_channels: PositiveInt = 12, init: float = 0.1) -> None:
        super().__init__()
        if gate_channels > cfg.d_model:
            raise ValueError(f"residual.smear.gate_channels={gate_channels}: the gate reads the first channels of the "
                             f"embedding, and model.d_model={cfg.d_model} has fewer; use 1 .. {cfg.d_model}")
        self.gate = nn.Parameter(torch.zeros(gate_channels))  # w: σ(0) = 1/2 at step 0
        self.lam = nn.Parameter(torch.tensor(float(init)))
        self.cut = bool(cfg.attention.get("doc_mask"))  # at document starts, under doc_mask

    def embed(self, x: torch.Tensor, idx: torch.Tensor, cache: KVCache | None, doc: torch.Tensor | None
              ) -> torch.Tensor:
        prev, has = look_back(x, cache, "smear", doc if self.cut else None)
        g = torch.sigmoid(x[..., :self.gate.numel()] @ self.gate.to(x.dtype))  # (B, T)
        return x + (self.lam.to(x.dtype) * g * has)[..., None] * prev


OPTIONS = {"smear": Smear}
