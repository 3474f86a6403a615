"""Absolute positions added to the token embeddings: fixed sinusoids and a learned table."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lmlab.model.position.base import Position
from lmlab.registry import PositiveFloat


class Sinusoidal(Position):
    """Fixed sinusoids added to the embeddings (Vaswani et al., 2017): PE[t, 2i] = sin(t / 10000^(2i/d)), cos at
    2i+1."""

    extrapolates = False  # defined at any length, but the model has never seen the larger angles

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, base: PositiveFloat = 10000.0, per_document: bool = False) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.dim, self.base, self.per_document = dim, base, per_document

    def table(self, T: int, device: torch.device) -> torch.Tensor:
        t = torch.arange(T, device=device, dtype=torch.float32)[:, None]  # (T, 1)
        inv = self.base ** (-torch.arange(0, self.dim, 2, device=device, dtype=torch.float32) / self.dim)  # (C/2,)
        pe = torch.zeros(T, self.dim, device=device)
        pe[:, 0::2] = torch.sin(t * inv)
        pe[:, 1::2] = torch.cos(t * inv[: self.dim // 2])
        return pe

    def embed(self, x: torch.Tensor, offset: int = 0, doc: torch.Tensor | None = None) -> torch.Tensor:
        table = self.table(offset + x.size(1), x.device).to(x.dtype)
        at = self.positions(x.size(1), offset, doc)
        return x + (table[offset:] if at is None else table[at])


class Learned(Position):
    """A learned table of absolute position embeddings (GPT-2's `wpe`); it ends at max_seq_len."""

    extrapolates = False
    table_bound = True

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any], *, per_document: bool = False) -> None:
        super().__init__(dim, head_dim, n_head, max_seq_len, train_len, scaling)
        self.wpe = nn.Embedding(max_seq_len, dim)
        self.per_document = per_document

    @classmethod
    def n_params(cls, dim: int, max_seq_len: int) -> int:
        return max_seq_len * dim  # the table: an HF config's n_positions=10^9 is 10^9 x n_embd of it

    def embed(self, x: torch.Tensor, offset: int = 0, doc: torch.Tensor | None = None) -> torch.Tensor:
        at = self.positions(x.size(1), offset, doc)
        if at is not None:  # within documents: never past the block's length either
            return x + self.wpe.weight[at]
        T = offset + x.size(1)
        if T > self.wpe.num_embeddings:
            raise ValueError(
                f"position=learned has a table of {self.wpe.num_embeddings} positions (model.max_seq_len); it cannot "
                f"embed a sequence of {T}. Use a scheme that extrapolates (position=rope|alibi|none) for longer inputs."
            )
        return x + self.wpe.weight[offset:T]


OPTIONS = {"sinusoidal": Sinusoidal, "learned": Learned}
