"""Positional schemes: one file per scheme, each ending in its `OPTIONS`, gathered here (a new scheme is its file,
its YAML and its test).

Contract: `Position(dim, head_dim, n_head, max_seq_len, train_len, scaling, *, <own params>)` with four
hooks, each a no-op unless the scheme overrides it, so `gpt.py` never asks which scheme it has:
- `embed(x, offset=0, doc=None)`: add absolute position information to the token embeddings, x (B, T, C);
- `rotate(q, k, offset=0, doc=None, layer=None)`: rotate queries and keys, (B, nh, T, hs) each, in layer `layer`;
- `attn_bias(T, device, dtype, offset=0)`: an additive (nh, T, offset + T) bias on the attention logits, or None;
- `score_bias(q, k, scale, offset=0)`: an additive (B, nh, T, S) bias computed from the queries and the keys
  themselves (CoPE's), −inf where j > i, or None.
`offset` is the position of the first of the T tokens: 0 for a whole text, the number of tokens already in the
KV cache when generating. `cache_key(length)` says when cached keys go stale: it changes with the text's length
only for schemes whose frequencies do (dynamic RoPE scalings), and a cache built under another key is rebuilt.
`extrapolates` says whether the scheme can run past the length it was trained at without a scaling method.
`doc` (B, offset + T) numbers the documents of a packed block (lmlab.model.mask.documents) when the model has
an end-of-document token; the schemes with `per_document=true` (sinusoidal, learned, RoPE) then count positions from
each document's first token instead of the block's.
`scaling` is the `rope_scaling` config; only RoPE accepts anything but `none`.

The files: `base.py` (the contract's class, `none`, the causal distances the learned biases share), `absolute.py`
(`sinusoidal`, `learned`), `rope.py`, `xpos.py`, the biases on the logits, `alibi.py`, `t5.py`, `fire.py`, and the
one that reads the queries and keys, `cope.py`.
"""

from __future__ import annotations

from lmlab.model.position.alibi import alibi_slopes
from lmlab.model.position.base import NoPE, Position, causal_distances
from lmlab.model.position.rope import RoPE
from lmlab.model.position.t5 import t5_bucket
from lmlab.model.rope_scaling import ROPE_SCALINGS, rope_frequencies
from lmlab.registry import gather

POSITIONS: dict[str, type[Position]] = gather(__name__, __path__, "OPTIONS")

__all__ = ["NoPE", "POSITIONS", "Position", "ROPE_SCALINGS", "RoPE", "alibi_slopes", "causal_distances",
           "rope_frequencies", "t5_bucket"]
