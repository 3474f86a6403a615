"""data.packing=padded: each document its own rows, never packed beside another — the variable-length batches the
BatchNorm argument is about (a batch statistic then mixes tokens with padding, in proportions that change from batch to
batch).

A document is the tokens up to and including its end-of-document token (`data.eod`, required); it is cut into
non-overlapping pieces of at most `block` = model.max_seq_len + 1 tokens, as packing cuts the stream, and each piece
is a row padded at the end with PAD. A piece of one token predicts nothing and is dropped. In a batch (`pair`), a
padded position reads token 0 and its target is IGNORE, which the loss leaves out (lmlab.model.loss), so under causal
attention a document's outputs and loss are exactly those it has alone: nothing before a token is padding. The rows
are held in memory, 4 bytes a position (packed blocks are views of the shards)."""

from __future__ import annotations

import numpy as np
import torch

PAD = -1  # a padded position in a row
IGNORE = -100  # its target: the loss's ignore_index


class PaddedRows(np.ndarray):
    """(n, block) int32, PAD after each piece's tokens; what the loaders and the unigram count read."""

    def target_counts(self, vocab_size: int) -> np.ndarray:
        """Counts of every token id among the targets (each row but its first position), padding left out."""
        targets = np.asarray(self)[:, 1:].ravel()
        return np.bincount(targets[targets != PAD], minlength=vocab_size)[:vocab_size].astype(np.int64)


def pad_documents(tokens: np.ndarray, block: int, eod_id: int) -> PaddedRows:
    """The rows of `tokens` (1-D ids): document d (ending at an `eod_id`, the last one at the end of the tokens) cut
    into pieces of ≤ `block` tokens, each a row padded with PAD, in order."""
    tokens = np.asarray(tokens)
    ends = np.flatnonzero(tokens == eod_id) + 1
    bounds = np.unique(np.concatenate([[0], ends, [len(tokens)]]))  # document d is tokens[bounds[d]:bounds[d + 1]]
    starts, lengths = bounds[:-1], np.diff(bounds)
    pieces = -(-lengths // block)  # per document
    piece_start = np.repeat(starts, pieces) + block * (np.arange(pieces.sum()) - np.repeat(np.cumsum(pieces) - pieces,
                                                                                                pieces))
    piece_len = np.minimum(block, np.repeat(starts + lengths, pieces) - piece_start)
    keep = piece_len >= 2
    piece_start, piece_len = piece_start[keep], piece_len[keep]
    rows = np.full((len(piece_start), block), PAD, dtype=np.int32)
    for lo in range(0, len(rows), 1 << 14):  # in chunks: the index matrix is 8 bytes a position
        s, n = piece_start[lo: lo + (1 << 14)], piece_len[lo: lo + (1 << 14)]
        at = np.arange(block)[None, :] < n[:, None]
        index = s[:, None] + np.arange(block)[None, :]
        rows[lo: lo + len(s)][at] = tokens[index[at]]
    return rows.view(PaddedRows)


def pair(row: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of a row, (block − 1,) each: padded inputs read token 0, padded targets are IGNORE."""
    t = torch.from_numpy(np.asarray(row).astype(np.int64))
    x, y = t[:-1], t[1:]
    if (pad := t == PAD).any():
        x, y = x.masked_fill(pad[:-1], 0), y.masked_fill(pad[1:], IGNORE)
    return x, y
