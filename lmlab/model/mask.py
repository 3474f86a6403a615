"""Which keys each query reads: the causal mask, optionally narrowed to a sliding window of the last W positions
(Child et al., 2019; Beltagy et al., 2020; Mistral), and the attention over it without a dense (T, T) matrix.

With document masking (`attention.doc_mask`), a query also reads only keys of its own document: packed blocks hold
the end of one document and the start of the next, and the second must not see the first. `documents` numbers the
documents of a block from its separator tokens: one that ends each document (EOD, `data.eod`: it belongs to the
document it ends) or one that opens each (BOS, the speedrun's .bin shards: it belongs to the document it opens).

Positions are absolute: the T queries sit at positions offset .. offset + T - 1 and the S keys at the S positions that
end with the last query (offset + T - S .. offset + T - 1: a KV cache of a windowed layer keeps only the last W - 1
keys). Query p reads key q when q <= p and, with a window W, p - q < W: W keys, itself included (transformers'
sliding window counts the same way). A window counted in blocks of g tokens (`BlockWindow`, attention.window_block)
reads whole blocks instead: ⌊p/g⌋ - ⌊q/g⌋ < W/g, the keys of the query's block up to itself and of the W/g - 1
blocks before it (the GPT-2 speedrun's block-causal sliding mask). Which window a layer reads when (a schedule over
training, windows for evaluation) is lmlab.model.attention.parts.window's.

Memory keys (`attention.mem_kv`) sit outside these positions: learned key/value pairs in front of the S keys, which
every query reads, with no position bias and no decay (`read_memory`). The forget gate (`attention.forget_gate`) adds
the decay D_ij = c_i - c_j to the logits of the keys a query reads (`forget_bias`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class BlockWindow(int):
    """A window of W keys counted in whole blocks of `block` tokens (attention.window_block; W a multiple of it): the
    query at position p, in block b = ⌊p/g⌋, reads the keys of blocks b - W/g + 1 .. b up to itself, so W - g + 1 + (p
    mod g) keys when the context reaches that far (W at a block's last query). An int, W itself, wherever a size is
    read (the KV cache keeps W - 1 keys, all any query reaches; a window W >= the context cuts nothing); the masks
    (`allowed`, `key_counts`, the banded and FlexAttention paths) read its `block`. Interned: one object per (W, g),
    so a compiled forward's guard on it holds while the window does."""

    block: int
    _made: dict[tuple[int, int], BlockWindow] = {}

    def __new__(cls, size: int, block: int) -> BlockWindow:
        if (size, block) not in cls._made:
            if size % block:
                raise ValueError(f"a window of {size} keys is not a whole number of blocks of {block}")
            made = super().__new__(cls, size)
            made.block = block
            cls._made[size, block] = made
        return cls._made[size, block]

    def __reduce__(self):  # a copy (deepcopy, pickle) is the interned object of the same (W, g)
        return BlockWindow, (int(self), self.block)

    def __repr__(self) -> str:
        return f"BlockWindow({int(self)}, block={self.block})"


def granule(window: int | None) -> int:
    """The block a window is counted in: its `block` (BlockWindow), else 1 (single tokens)."""
    return window.block if isinstance(window, BlockWindow) else 1


def first_key(p: int, window: int) -> int:
    """The position of the first key the query at position p reads under `window` (before the causal start 0):
    p - W + 1, or the first key of the window's first block."""
    g = granule(window)
    return p - window + 1 if g == 1 else (p // g - window // g + 1) * g


def allowed(T: int, offset: int, S: int, window: int | None, device: torch.device, causal: bool = True
            ) -> torch.Tensor:
    """(T, S) bool: True where query i (at position offset + i) reads key j (at position offset + T - S + j).
    `causal=False` (a bidirectional model, head=mlm: lmlab.model.position.Position.causal): every key, no window."""
    if not causal:
        return torch.ones(T, S, dtype=torch.bool, device=device)
    q = torch.arange(offset, offset + T, device=device)[:, None]
    k = torch.arange(offset + T - S, offset + T, device=device)[None, :]
    mask = k <= q
    if window is None:
        return mask
    g = granule(window)
    return mask & (q - k < window if g == 1 else q // g - k // g < window // g)


def documents(idx: torch.Tensor, sep_id: int, first: torch.Tensor | None = None, opens: bool = False) -> torch.Tensor:
    """(B, T) document numbers of the tokens idx (B, T), found by the separator `sep_id`: each one ends its document
    (EOD), or with `opens` each one opens the next (BOS; the tokens before a block's first separator are the end of a
    document of their own). `first` (B,) is the number of the document a token that continues the text is in (0 at
    the start of a text; a KV cache's count past its tokens: the cached separators)."""
    seps = (idx == sep_id).long()
    start = 0 if first is None else first[:, None]
    return start + seps.cumsum(-1) - (0 if opens else seps)


def doc_positions(doc: torch.Tensor, T: int) -> torch.Tensor:
    """(B, T) the last T tokens' positions within their documents (0 at each document's first token), given every
    position's document number doc (B, offset + T): position.per_document restarts the count there."""
    offset = doc.size(1) - T
    q_doc = doc[:, offset:].contiguous()
    return torch.arange(offset, offset + T, device=doc.device) - torch.searchsorted(doc.contiguous(), q_doc)


def doc_allowed(mask: torch.Tensor, doc: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`mask` (T, S) narrowed to each query's own document: (B, 1, T, S) given doc = (the queries' document numbers
    (B, T), the keys' (B, S)); `mask` itself without documents."""
    if doc is None:
        return mask
    q_doc, k_doc = doc
    return mask & (q_doc[:, None, :, None] == k_doc[:, None, None, :])


def key_counts(T: int, offset: int, device: torch.device, window: int | None = None,
               doc: torch.Tensor | None = None, causal: bool = True) -> torch.Tensor:
    """n_i: how many keys query i (at position offset + i) reads, float: offset + i + 1, at most the window, (T,);
    with `doc` (B, offset + T), every position's document number, the keys of its own document only, (B, T).
    A block-counted window (`BlockWindow`) caps query p at the keys from its window's first block, p - `first_key`
    + 1. `causal=False` (bidirectional: no window): every query reads all offset + T keys, or its whole document."""
    if not causal:  # every key of the text, or with documents of the query's own document (its size)
        if doc is None:
            return torch.full((T,), float(offset + T), device=device)
        q_doc, keys = doc[:, offset:].contiguous(), doc.contiguous()
        return (torch.searchsorted(keys, q_doc, right=True) - torch.searchsorted(keys, q_doc)).float()
    n = torch.arange(offset + 1, offset + T + 1, device=device, dtype=torch.float32)
    if doc is not None:  # documents are numbered in order: each one starts where its number first appears
        q_doc = doc[:, offset:].contiguous()
        n = n - torch.searchsorted(doc.contiguous(), q_doc).float()
    if window is None:
        return n
    g = granule(window)
    if g == 1:
        return n.clamp_max(window)
    p = torch.arange(offset, offset + T, device=device)
    return torch.minimum(n, (p % g + window - g + 1).to(n.dtype))  # the keys from the window's first block


def forget_bias(forget: tuple[torch.Tensor, torch.Tensor], rows: slice = slice(None), keys: slice = slice(None)
                ) -> torch.Tensor:
    """The forget gate's decay D_ij = c_i - c_j = Σ_{l=j+1..i} log f_l (B, h, t, s), given forget = (c of the queries
    (B, h, T), c of the keys (B, h, S)), c_t = Σ_{l<=t} log f_l (Lin et al., 2025, FoX): for the queries `rows` and the
    keys `keys`. Only the gates between key and query enter, so where the cumulative sum starts does not matter (a
    document in a packed block, a cache's continuation)."""
    c_q, c_k = forget
    return c_q[..., rows, None] - c_k[..., None, keys]


def read_memory(mask: torch.Tensor, n_mem: int) -> torch.Tensor:
    """`mask` (..., T, S), which keys a query reads (bool) or their bias (float, -inf where it does not), with n_mem
    memory columns in front that every query reads with no bias (True; 0): memory keys have no position."""
    return F.pad(mask, (n_mem, 0), value=True if mask.dtype == torch.bool else 0.0) if n_mem else mask


def banded_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float, window: int, offset: int,
                bias: torch.Tensor | None = None, dropout_p: float = 0.0, block: int | None = None,
                doc: tuple[torch.Tensor, torch.Tensor] | None = None,
                forget: tuple[torch.Tensor, torch.Tensor] | None = None, n_mem: int = 0) -> torch.Tensor:
    """Softmax attention under a window of W keys, a block of queries at a time: each block of (at most W) queries
    reads only the keys its window reaches (the block's own plus the W - 1 before it), through SDPA with that small
    mask (a window counted in blocks, `BlockWindow`: the blocks its first query's window reaches). Memory and time
    O(T·W), never a (T, T) matrix. q (B, h, T, d), k and v (B, hkv, n_mem + S, d) (key heads
    shared by query heads are expanded by SDPA; the first n_mem keys memory, read by every block), `bias` (h, T, S) a
    position bias (ALiBi) or None, `doc` the queries' and the keys' document numbers (`doc_allowed`) or None, `forget`
    the forget gate's cumulative sums (`forget_bias`) or None -> (B, h, T, d)."""
    T, S = q.size(-2), k.size(-2) - n_mem
    first = offset + T - S  # the position of key 0
    block = block or max(1, min(T, window))
    out = []
    for a in range(0, T, block):
        b = min(T, a + block)
        lo = max(first, first_key(offset + a, window))  # the first key position any query of the block reads
        keys = slice(lo - first, offset + b - first)
        mask = allowed(b - a, offset + a, keys.stop - keys.start, window, q.device)
        if doc is not None:
            mask = doc_allowed(mask, (doc[0][:, a:b], doc[1][:, keys]))
        add = None if bias is None else bias[..., a:b, keys]
        if forget is not None:
            decay = forget_bias(forget, slice(a, b), keys).to(q.dtype)
            add = decay if add is None else add + decay
        if add is not None:
            mask = add.masked_fill(~mask, float("-inf"))
        kb, vb = (t[..., n_mem + keys.start:n_mem + keys.stop, :] for t in (k, v))
        if n_mem:  # the memory, then the block's keys
            kb, vb = torch.cat((k[..., :n_mem, :], kb), dim=-2), torch.cat((v[..., :n_mem, :], vb), dim=-2)
        out.append(F.scaled_dot_product_attention(q[..., a:b, :], kb, vb, attn_mask=read_memory(mask, n_mem),
                                                  dropout_p=dropout_p, scale=scale,
                                                  enable_gqa=q.size(1) != k.size(1)))
    return torch.cat(out, dim=-2)


def layer_window(window: int | None, pattern: list | None, layer: int, n_layer: int, max_len: int) -> int | None:
    """The window of layer `layer` (None: it reads the whole causal context). `pattern`, cycled over the layers,
    names each layer `local` (the `window`), `global`, or gives its own window; its length must divide n_layer (a
    pattern of 4 over 6 layers would leave the last group cut)."""
    def check(key: str, w: int) -> int:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise ValueError(f"{key}={w!r} must be a window of >= 1 keys (or null: the whole context)")
        if w > max_len:
            raise ValueError(f"{key}={w} is larger than the context (model.max_seq_len={max_len}): a window that "
                             f"long is the whole context; use null, or a window <= {max_len}")
        return w

    if window is not None:
        check("attention.window", window)
    if pattern is None:
        return window
    pattern = list(pattern)
    if not pattern or n_layer % len(pattern):
        raise ValueError(f"attention.pattern={pattern} has {len(pattern)} entries, which must divide model.n_layer="
                         f"{n_layer} (the pattern repeats over the layers); e.g. [local,local,local,global] for 4, 8, "
                         f"12 layers")
    entry = pattern[layer % len(pattern)]
    if entry == "global":
        return None
    if entry == "local":
        if window is None:
            raise ValueError(f"attention.pattern={pattern} has local layers but attention.window is null; set "
                             f"attention.window=W (the local layers' window), or give each layer its window")
        return window
    if isinstance(entry, str):
        raise ValueError(f"attention.pattern entry {entry!r} is not local, global or a window size (an integer)")
    return check(f"attention.pattern[{layer % len(pattern)}]", entry)
