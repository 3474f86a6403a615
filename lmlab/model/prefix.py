"""`head=prefix`: next-token prediction plus the GPT-2 speedrun's prefix-token auxiliary loss (modded-nanogpt,
record 88, 2026-07-13, "Prefix token prediction", PR #337).

Every token t has a prefix token P(t): the token whose string is the longest proper prefix of t's string that is itself
a token; P(t) = −1 when there is none (a single character, a single byte). The record reads GPT-2's byte strings
(tiktoken's mergeable ranks); here the strings are the tokenizer's vocabulary (`tokenizers`' get_vocab), which for a
byte-level BPE (GPT-2's tokenizer.json, lmlab's data.tokenizer=bpe) writes each byte as one character, so the rule is
the record's: " the" → " th" (when that is a token), "ing" → "in", a lone byte → none. Special tokens (the
tokenizer's added tokens, its unknown token, the data's end-of-document token) neither have a prefix nor are one, as
<|endoftext|> is not among the record's ranks. A character-level vocabulary has no prefix at all: it is refused by key.

The same logits z_i that predict the next token t_{i+1} (the output head's, with the model's softcap, µP multiplier
and chunking) are scored on its prefix token too:

    L_prefix = (1/N) Σ_i [P(t_{i+1}) ≥ 0] · CE(z_i, P(t_{i+1})),      objective = L_next + w · L_prefix

N the positions the next-token loss counts. A target without a prefix adds nothing but still counts in N, as in the
record (its kernel skips the term; its loss is a sum over every position), so w acts at w times the share of targets
that have a prefix. The record's w is 0.25 for the first third of its schedule, falls linearly to 0 by two thirds and
stays 0 after: `fade=[a, b]` is that schedule (w × 1 until a·max_steps, then linearly to 0 at b·max_steps; the record's
[0.333, 0.667]), set from the step by the training loop (`set_step`, a function of the step alone: a resume reads the
uninterrupted run's factor) into a buffer, so a compiled forward sees no new constant; with a fade,
`train/prefix_loss` logs the faded L_prefix (the factor times it), the part the objective carries before w. Without
one (null, the default) w is constant. The record fuses both terms into one cross-entropy kernel on one set of
logits; here the output head runs twice (its FLOPs count is the model's: the same logits).

Training only (`model.train()`), as in the record: validation, eval.py, generation and export read the next-token
model, the same as head=next with the same weights. `train/prefix_loss` logs L_prefix before its weight. `weight=0`:
nothing is computed (head=next's path exactly).

The table reaches the model through its record, as the data's end-of-document id does (model.eod_id): `head.prefixes`
(null in the YAML) is filled by the run from the data's tokenizer (`fit_vocabulary`, called by lmlab.run.plan), a list
of model.vocab_size ids, −1 for none, kept in the model record (not in the run's config: GPT-2's is 50,257 numbers),
so a checkpoint rebuilds the model without its tokenizer. From Python: `head={"name": "prefix", "prefixes":
prefix_table(vocab, size)}`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import torch

from lmlab.model.encoder import IGNORE
from lmlab.model.next_token import NextToken
from lmlab.model.side import Term
from lmlab.registry import NonNegativeFloat, option_defaults

if TYPE_CHECKING:
    from lmlab.config import GPTConfig

PREFIX_LOSS = "prefix_loss"  # its side-channel term (lmlab.model.side): train/prefix_loss, L_prefix before its weight
NONE = -1  # a token without a prefix token


def prefix_table(vocab: Mapping[str, int], size: int, skip: Iterable[int | None] = ()) -> list[int]:
    """P(t) for every id t < size: the id of the longest proper prefix of t's string that is a token, else −1. `vocab`
    maps each token's string to its id; the ids in `skip` (special tokens) neither get a prefix nor are one."""
    skipped = {i for i in skip if i is not None}
    ids = {s: i for s, i in vocab.items() if i not in skipped and 0 <= i < size}
    table = [NONE] * size
    for s, i in ids.items():
        for k in range(len(s) - 1, 0, -1):  # longest first
            if (p := ids.get(s[:k])) is not None:
                table[i] = p
                break
    return table


def tokenizer_prefixes(tokenizer: Any, size: int, eod_id: int | None = None) -> list[int]:
    """`prefix_table` of a `tokenizers.Tokenizer` (read by its methods, not imported): its vocabulary, its added tokens,
    its model's unknown token and the data's end-of-document id `eod_id` skipped."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    special = [*tokenizer.get_added_tokens_decoder(), eod_id]
    if (unk := getattr(tokenizer.model, "unk_token", None)) is not None:
        special.append(vocab.get(unk))
    return prefix_table(vocab, size, special)


def prefix_loss(h: torch.Tensor, targets: torch.Tensor, table: torch.Tensor, lm_loss: Callable[..., torch.Tensor]
                ) -> torch.Tensor:
    """L_prefix of the normed final hidden states h (B, T, d) with next-token targets (B, T) (module docstring):
    `lm_loss(h, prefix targets)`, the output head's mean cross-entropy over the positions whose target has a prefix,
    times their share of the counted positions; 0 when none has one."""
    counted = targets != IGNORE
    prefix = table[torch.where(counted, targets, 0)]  # (B, T) P(t_{i+1})
    prefix = torch.where(counted & (prefix != NONE), prefix, IGNORE)
    n = (prefix != IGNORE).sum()
    ce = lm_loss(h, prefix)  # mean over the n positions with a prefix (0 / 0 when n = 0: dropped below)
    return torch.where(n > 0, ce, 0.0) * n / counted.sum().clamp(min=1)


class PrefixToken(NextToken):
    """The next token, and in training each target's prefix token from the same logits (module docstring)."""

    def __init__(self, cfg: GPTConfig, *, weight: NonNegativeFloat = 0.25, prefixes: list[int] | None = None,
                 fade: list[float] | None = None) -> None:
        super().__init__(cfg)
        self.weight = float(weight)
        if fade is not None and (len(fade) != 2 or not 0 <= fade[0] < fade[1] <= 1):
            raise ValueError(f"head.fade={list(fade)} must be [a, b] with 0 <= a < b <= 1: the weight falls linearly "
                             f"from w at a·max_steps to 0 at b·max_steps (the record's [0.333, 0.667]), or null")
        self.fade = None if fade is None else (float(fade[0]), float(fade[1]))
        self.register_buffer("factor", torch.ones(()), persistent=False)  # the fade's, set by `set_step`
        self.weights = (self.weight,) if self.weight else ()  # its term's weight in the objective
        table = None
        if prefixes is not None:
            _check_table(torch.as_tensor(list(prefixes), dtype=torch.long, device="cpu"), cfg.vocab_size)
            table = torch.as_tensor(list(prefixes), dtype=torch.long)  # on the device the model is built on
        # Not in the state dict: the model record holds it (a head=next model loads these weights as they are).
        self.register_buffer("table", table, persistent=False)
        self._term: Term | None = None

    def set_step(self, step: int, max_steps: int) -> None:
        """The fade's factor at `step` of `max_steps`: 1 until a, linearly to 0 at b, 0 after (1 without a fade)."""
        if self.fade is not None:
            a, b = self.fade
            x = step / max(1, max_steps)
            self.factor.fill_(min(1.0, max(0.0, (b - x) / (b - a))))

    @classmethod
    def fit_vocabulary(cls, spec: dict[str, Any], tokenizer: Any, vocab_size: int, eod_id: int | None,
                       data: str | None) -> dict[str, Any]:
        """The spec with `prefixes` worked out from the data's tokenizer (when null), or a refusal naming the key: a
        data set without a tokenizer, a vocabulary in which no token has a prefix token while `weight` > 0."""
        if spec.get("prefixes") is not None:
            return dict(spec)
        if tokenizer is None:
            raise ValueError(f"head=prefix reads the tokenizer's vocabulary (each token's longest prefix token); "
                             f"data={data} has no tokenizer: use a text corpus or data=token_bin with "
                             f"data.tokenizer=<its tokenizer.json>, or give head.prefixes")
        prefixes = tokenizer_prefixes(tokenizer, vocab_size, eod_id)
        if float(spec.get("weight", option_defaults(cls)["weight"])) > 0 and all(p == NONE for p in prefixes):
            raise ValueError(f"head=prefix: no token of data={data}'s vocabulary (data.tokenizer) has a prefix token "
                             f"(a proper prefix of its string that is itself a token), so head.weight would train "
                             f"nothing; a character-level tokenizer (data.tokenizer=char) or data=token_bin's "
                             f"stand-in has none: use data.tokenizer=bpe (or GPT-2's tokenizer.json), or head=next")
        return {**spec, "prefixes": prefixes}

    @property
    def declared(self) -> dict[str, tuple[str, ...]]:
        """The term it records (lmlab.model.side): L_prefix, in training, when it has a weight."""
        return {PREFIX_LOSS: ("train",)} if self.weight else {}

    def loss(self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor, lm_loss: Callable[..., Any],
             z_loss: float = 0.0, parts: bool = False) -> Any:
        """The next-token loss (with its z-loss); in training L_prefix is recorded for `terms` (the same h)."""
        self._term = None
        if self.weight and self.training:
            if self.table is None:
                raise ValueError("head=prefix has no prefix table (head.prefixes=null): a run fills it from the data's "
                                 "tokenizer; from Python give head.prefixes=lmlab.model.prefix.prefix_table(...)")
            value = prefix_loss(h, targets, self.table, lm_loss)
            self._term = Term(PREFIX_LOSS, value if self.fade is None else value * self.factor, self.weight)
        return lm_loss(h, targets, z_loss=z_loss, parts=parts)

    def terms(self, *args: Any) -> list[Term]:
        """The last training loss's L_prefix, with its weight (none in eval or at weight 0)."""
        term, self._term = self._term, None
        return [] if term is None else [term]


def _check_table(table: torch.Tensor, vocab_size: int) -> None:
    """A prefix table of one id per token, each −1 or another token's id; else a ValueError naming head.prefixes."""
    if table.dim() != 1 or table.numel() != vocab_size:
        raise ValueError(f"head.prefixes has {table.numel()} entries; it needs one per token of the vocabulary "
                         f"(model.vocab_size={vocab_size}): the id of its prefix token, or -1 for none")
    bad = (table < NONE) | (table >= vocab_size) | (table == torch.arange(vocab_size, device=table.device))
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"head.prefixes[{i}]={int(table[i])} must be -1 (no prefix) or the id of another token "
                         f"(0 ≤ id < model.vocab_size={vocab_size}, not {i} itself)")
