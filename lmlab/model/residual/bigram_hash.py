"""`residual=bigram_hash`: an extra embedding table read at a hash of each token and the one before it, added to
every layer's input (the GPT-2 speedrun's bigram hash embedding, record 62, 2026-01-19, @classiclarryd, after Svenstrup
et al., 2017, "Hash Embeddings for Efficient Word Representations"; the sign trick of record 83, 2026-05-20, @TrianX,
after Chen et al., 2015, "Compressing Neural Networks with the Hashing Trick"):

    h_t = ((36313·x_t) XOR (27191·x_{t−1})) mod (S − 1),   h = S − 1 for the text's first token (a reserved row)
    b_t = s_t ⊙ E[h_t]                                       (E: S × `dim`; s_t = ±1, see `signs`)
    x_l ← x_l + λ_l·b_t  at the input of every layer l      (λ_l learned per layer, init `init`)

the record's `get_bigram_hash` (its int32 products, kept here in int64: the same rows for a vocabulary of up to 59,138)
and its `x = ... + bigram_lambdas[i] * x0_bigram` at each layer's input. S = `size` rows (null: 5 × vocab_size, record
62's; record 83's is 15 × vocab_size). `dim` < d_model adds b to the first `dim` channels only (record 83: d/4).
`signs` > 0 is record 83's sign trick: s_t is row ((x_{t−1} XOR x_t) mod `signs`) of a fixed random ±1 table
(`signs` × `dim`, row 0 for a first token), so bigrams that share a row of E add it with different signs (record 83:
8192 rows); 0 is record 62's, s = 1. Record 83 also moves the injection of layers ≥ 1 after their attention, which
the residual hooks do not reach: here every layer's input.

E is an nn.Embedding: the model's `init` draws it as every table (the record zero-inits it; from zero, λ gets no
gradient at step 0) and it sits in the optimizer's embedding group, never Muon's, without decay (the record's Adam
decays it). λ starts at 0.1 (record 62's; record 83's 0.05). E's S·dim weights count in `n_params`.

Documents: the record hashes over its packed batch, a document's first token with the last one of the document
before ("Masking this ran slower and showed no improvement"). Under attention.doc_mask lmlab gives a document's first
token the reserved row (and sign row 0), as the text's first, so a packed document reads as it would alone. When
generating, the KV cache keeps the last token (`cache.layers[0].inputs["bigram_hash"]`) for the next forward's first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.residual.smear import look_back
from lmlab.registry import NonNegativeInt, PositiveInt, Range

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import KVCache

MUL_CURRENT, MUL_PREVIOUS = 36313, 27191  # the record's "arbitrary large ints"
Rows = Annotated[int, Range(ge=2)]  # one row reserved for a token with no previous one, at least one for bigrams


def bigram_hash(idx: torch.Tensor, prev: torch.Tensor, has: torch.Tensor, size: int) -> torch.Tensor:
    """The table row of each token (B, T), given the token before it and whether it has one."""
    h = torch.bitwise_xor(MUL_CURRENT * idx, MUL_PREVIOUS * prev) % (size - 1)
    return torch.where(has, h, size - 1)


class BigramHash(nn.Module):
    def __init__(self, cfg: GPTConfig, *, size: Rows | None = None, dim: PositiveInt | None = None,
                 signs: NonNegativeInt = 0, init: float = 0.1) -> None:
        super().__init__()
        self.size, self.dim = self.sizes(cfg, size, dim)
        self.table = nn.Embedding(self.size, self.dim)
        self.lambdas = nn.Parameter(torch.full((cfg.n_layer,), float(init)))
        self.pad = cfg.d_model - self.dim
        self.cut = bool(cfg.attention.get("doc_mask"))  # at document starts, under doc_mask
        if signs:  # a fixed ±1 table, the same at every build (not saved)
            draw = torch.randint(0, 2, (signs, self.dim), generator=torch.Generator().manual_seed(0), device="cpu")
            self.register_buffer("signs", (2 * draw - 1).to(torch.int8).to(torch.get_default_device()),
                                 persistent=False)
        else:
            self.signs = None
        self.rows: torch.Tensor | None = None  # this forward's b, (B, T, d_model)

    @staticmethod
    def sizes(cfg: GPTConfig, size: int | None, dim: int | None) -> tuple[int, int]:
        """(table rows, width)."""
        if dim is not None and dim > cfg.d_model:
            raise ValueError(f"residual.bigram_hash.dim={dim} is wider than model.d_model={cfg.d_model}: use 1 .. "
                             f"{cfg.d_model}, or null for d_model")
        return 5 * cfg.vocab_size if size is None else size, cfg.d_model if dim is None else dim

    @classmethod
    def n_params(cls, cfg: GPTConfig, *, size: int | None = None, dim: int | None = None, signs: int = 0,
                 init: float = 0.1) -> int:
        rows, width = cls.sizes(cfg, size, dim)
        return rows * width + cfg.n_layer

    def embed(self, x: torch.Tensor, idx: torch.Tensor, cache: KVCache | None, doc: torch.Tensor | None
              ) -> torch.Tensor:
        prev, has = look_back(idx, cache, "bigram_hash", doc if self.cut else None)
        b = self.table(bigram_hash(idx, prev, has, self.size))  # (B, T, dim)
        if self.signs is not None:
            b = b * self.signs[torch.where(has, torch.bitwise_xor(prev, idx) % self.signs.size(0), 0)].to(b.dtype)
        self.rows = F.pad(b, (0, self.pad)) if self.pad else b
        return x

    def before(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x + self.lambdas[i].to(x.dtype) * self.rows.to(x.dtype)


OPTIONS = {"bigram_hash": BigramHash}
