"""What compare ranks runs by: their best val loss (nats per token), or, when the compared runs used different
tokenizers, their best val bits per byte, because a token is not the same unit across tokenizers (a char run's loss
per character is far below a BPE run's per merged token at the same bits per byte). The report says which, in one
line above its tables."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

LOSS, BPB = "best_val_loss", "best_val_bpb"


def tokenizer_of(summary: Mapping[str, Any]) -> str | None:
    """The tokenizer a run trained with, from its recorded config: data.tokenizer, with data.vocab_size for bpe (char
    ignores it); a data set's own ids (data.tokenizer null: token_bin's stand-in, a synthetic task) by its data.name.
    None for a summary without a config (an older or incomplete run: it says nothing either way)."""
    data = (summary.get("config") or {}).get("data")
    if not isinstance(data, Mapping):
        return None
    kind = data.get("tokenizer")
    if kind is None:
        return f"{data.get('name')}'s ids"
    return f"bpe (vocab_size {data.get('vocab_size')})" if kind == "bpe" else str(kind)


def ranked_by(summaries: Iterable[Mapping[str, Any]]) -> tuple[str, str | None]:
    """The figure compare ranks by (LOSS, or BPB when the runs' tokenizers differ) and the line that says so (None:
    the val loss, as always)."""
    kinds = sorted({k for s in summaries if (k := tokenizer_of(s)) is not None})
    if len(kinds) < 2:
        return LOSS, None
    return BPB, (f"the runs used different tokenizers ({', '.join(kinds)}): nats per token are not comparable across "
                 f"them, so runs are ranked by {BPB} (bits per byte of the validation text), best first")
