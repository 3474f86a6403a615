"""The KV cache: keys and values of the tokens a model has already read, so each generated token costs one
position's forward instead of the whole text's.

`GPT.forward(idx, cache=cache)` reads the T new tokens as positions `cache.length` .. `cache.length + T - 1` and
appends their keys and values (after the position scheme's rotation). Keys are only valid under the frequencies
they were rotated with: `key` records the position scheme's `cache_key` at the length the cache was built for, and
`lmlab.analysis.generate` rebuilds the cache when it changes (dynamic RoPE scalings past the trained length), so cached
generation gives the logits of a full forward over the growing text.
"""

from __future__ import annotations

import torch


class LayerCache:
    """One layer's keys and values, (B, nkv, length, hs) each; `offset`: where this forward's tokens start. A
    recurrent mixer's layer (lmlab.model.mixer) keeps its fixed-size state in `state` instead (its own tensors by
    name, e.g. the conv window and the recurrent state), and no keys or values. `inputs`: what the block's input
    transforms keep between forwards, by name (a canon layer's last inputs; lmlab.model.residual.canon), beside
    either. `forget`: with attention.forget_gate, each cached key's cumulative log forget gate c_j (B, nh, length),
    which the decay of the next queries' logits reads (lmlab.model.mask.forget_bias)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.forget: torch.Tensor | None = None
        self.state: dict[str, torch.Tensor] = {}
        self.inputs: dict[str, torch.Tensor] = {}
        self.offset = 0

    @property
    def bytes(self) -> int:
        """What this layer holds now: its keys and values (and forget sums), or its recurrent state, and its input
        transforms'."""
        held = [t for t in (self.k, self.v, self.forget, *self.state.values(), *self.inputs.values()) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat((self.k, k), dim=-2)
        self.v = v if self.v is None else torch.cat((self.v, v), dim=-2)
        return self.k, self.v

    def append_forget(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' cumulative log forget gates c (B, nh, T), counted from 0, continued from the last cached
        key's; returns them and every cached key's (B, nh, length). Only differences c_i - c_j are read, so a cache
        whose keys are all dropped (a window of 1) may start again from 0."""
        if self.forget is not None and self.forget.size(-1):
            c = c + self.forget[..., -1:]
        self.forget = c if self.forget is None else torch.cat((self.forget, c), dim=-1)
        return c, self.forget

    def keep_last(self, n: int) -> None:
        """Drop all but the last `n` keys and values (a windowed layer needs no more for the tokens to come)."""
        if self.k is not None and self.k.size(-2) > n:
            self.k, self.v = self.k[..., self.k.size(-2) - n:, :], self.v[..., self.v.size(-2) - n:, :]
        if self.forget is not None and self.forget.size(-1) > n:
            self.forget = self.forget[..., self.forget.size(-1) - n:]


class KVCache:
    def __init__(self, n_layer: int) -> None:
        self.layers = [LayerCache() for _ in range(n_layer)]
        self.length = 0  # tokens read so far
        self.key: object = None  # the position scheme's cache_key the keys were rotated under
        self.doc: torch.Tensor | None = None  # (B, length) the tokens' document numbers (attention.doc_mask)
        self.doc_next: torch.Tensor | None = None  # (B,) the document the next token belongs to

    def start(self) -> None:
        """Before a forward: its tokens start where the cached ones end."""
        for layer in self.layers:
            layer.offset = self.length
