"""The contract every position scheme implements (the package's docstring says it in full), the scheme without
positions, and the causal distances the learned biases share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from lmlab.model.mask import doc_positions


class Position(nn.Module):
    extrapolates = True  # runs past the trained length without a scaling method and stays sensible
    accepts_scaling = False  # takes a rope_scaling other than none
    table_bound = False  # cannot run past max_seq_len at all (a learned table)
    # Which keys a query reads, for every attention path (lmlab.model.attention.score reads it here, the one object
    # each of them is handed): True, the keys at or before it; False, every key (head=mlm, a bidirectional encoder;
    # the GPT sets it from its head). The biases below are built for it.
    causal = True
    causal_only: str | None = None  # why the scheme has no bidirectional form (the GPT refuses head=mlm with it)
    # how it reaches the attention logits besides q·k (None: it does not, it rotates or embeds): a bias added to them
    # (T5, FIRE, CoPE, ALiBi), which optim.qk_clip's measured maximum would include while it rescales W_q, W_k only
    logit_bias: str | None = None

    def __init__(self, dim: int, head_dim: int, n_head: int, max_seq_len: int, train_len: int,
                 scaling: Mapping[str, Any]) -> None:
        super().__init__()
        self.max_seq_len, self.train_len = max_seq_len, train_len

    @classmethod
    def n_params(cls, dim: int, max_seq_len: int) -> int:
        """The weights the scheme learns, from the sizes alone (lmlab.model.resolve.n_params_estimate)."""
        return 0

    per_document = False  # positions count from each document's start (the schemes that take `per_document`)

    def follow(self, windows: list[Any]) -> None:
        """The windows of the model's attention layers (None where a layer has none), handed over once built: a scheme
        that follows them (RoPE's window_yarn) takes them here; the others leave them."""

    def embed(self, x: torch.Tensor, offset: int = 0, doc: torch.Tensor | None = None) -> torch.Tensor:
        return x

    def rotate(self, q: torch.Tensor, k: torch.Tensor, offset: int = 0, doc: torch.Tensor | None = None,
               layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return q, k

    def positions(self, T: int, offset: int, doc: torch.Tensor | None) -> torch.Tensor | None:
        """(B, T) the tokens' positions within their documents under `per_document`, else None (offset .. offset +
        T - 1 for every sequence)."""
        if not self.per_document:
            return None
        if doc is None:
            raise ValueError("position.per_document=true needs the documents: set data.eod (the end-of-document "
                             "token they are found by; data=token_bin: data.doc_sep)")
        return doc_positions(doc, T)

    def attn_bias(self, T: int, device: torch.device, dtype: torch.dtype, offset: int = 0) -> torch.Tensor | None:
        return None

    def score_bias(self, q: torch.Tensor, k: torch.Tensor, scale: float, offset: int = 0) -> torch.Tensor | None:
        """An additive (B, nh, T, S) bias on the logits that reads the queries and keys themselves (CoPE's), −inf
        where a key comes after its query, or None. q (B, nh, T, hs) as the logits read it (the score's query factor
        in), k (B, nkv, S, hs) the S keys ending with the last query (a KV cache's first; no memory keys), `scale` the
        attention's logit scale. A window or documents narrow the keys read on top, as for `attn_bias`."""
        return None

    def cache_key(self, length: int) -> object:
        return None

    @classmethod
    def attention_bytes(cls, n_head: int, T: int, batch: int) -> int:
        """Memory that attention over `batch` sequences of length T needs because of this scheme (checked against
        the free memory before a length is run). 0: no bias, so attention stays on SDPA's causal kernels, whose
        memory grows with T, not T²."""
        return 0


class NoPE(Position):
    """No positional information (Kazemnejad et al., 2023): causal attention alone breaks permutation symmetry."""

    causal_only = ("position=none leaves a bidirectional model permutation-equivariant (only the causal mask tells a "
                   "NoPE model where it is): it could not tell the order of its tokens; use position=rope")


def causal_distances(T: int, offset: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, offset + T) distances i − j from the queries at offset .. offset + T − 1 to every key so far, and the
    mask of the future keys (j > i), for the learned biases (t5.py, fire.py)."""
    i = torch.arange(offset, offset + T, device=device)[:, None]
    dist = i - torch.arange(offset + T, device=device)[None, :]
    return dist, dist < 0


OPTIONS = {"none": NoPE}
