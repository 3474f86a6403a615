"""The encoder objectives of the `head` axis: `mlm`, a bidirectional masked language model (BERT's objective, which
RoFormerV2 and GAU-α were pretrained with), and `classify`, a sequence classifier fine-tuned on a labelled set.

Both make the model read the whole text in every layer: the head's `causal = False` is set on the position scheme,
which every attention path reads (lmlab.model.attention.score: SDPA without its causal mask, the explicit and flex
paths with every key, ALiBi and T5 with their two-sided biases, softmax_plus and relu² counting every key of the
text); what has no two-sided form (windows, the forget gate, recurrent mixers, FIRE, CoPE, xPos, NoPE) says so with
its `causal_only` and the model refuses it by key. Neither predicts a next token, so generation, the KV cache,
eval.py's per-position loss and export=hf refuse them.

Both read one id past the tokenizer's (`reserved = 1`): [MASK], the model's last id, `model.vocab_size − 1` (a run
sets model.vocab_size to the tokenizer's size plus the head's `reserved`). The tokenizer is left as it is: a run's
tokenizer.json round-trips unchanged and init_from takes it as it is; only the embedding (and the output head, as
BERT's, whose softmax covers [MASK] too; no target is ever [MASK]) has the one more row.

`mlm` (Devlin et al., 2019, "BERT", §3.1 and Appendix A.1): in each sequence round(mask_prob · n) of its n positions
(at least one) are chosen uniformly without replacement; of those, each independently becomes [MASK] with probability
`mask_frac` (0.8), a uniformly random token with probability `random_frac` (0.1), and stays as it is otherwise (0.1).
The loss is the cross-entropy of the original tokens at the chosen positions only (the others are the loss's ignore
index), through the model's own output head (softcap, µP's multiplier, chunked or not). The draws of a sequence are a
pure function of a key: in training (the run's seed, its global sample index, which the data order is a function of
too), so a resumed run masks exactly as the uninterrupted one; in validation (a fixed seed, the window's index), so
every run of any seed masks the validation windows alike and their val/loss, the masked-token loss, compare.

`classify`: the final hidden states (after the final norm) pooled over the text — `mean` over its tokens, padding
([MASK], which data=labelled pads with) left out, or the `first` token's — and mapped to one logit per label by a
linear layer; the loss is the cross-entropy of the label, `train/accuracy` and `val/accuracy` are logged beside it.
`labels` are the label names, which data=labelled fills in from its file. The padding is read by attention as a
token (there is no key-padding mask; data=labelled pads every example to model.max_seq_len, so an example's
prediction depends on itself alone, never on the batch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
import torch
from torch import nn

from lmlab.model.loss import cross_entropy
from lmlab.model.side import Term
from lmlab.registry import Range

if TYPE_CHECKING:
    from lmlab.config import GPTConfig

TRAIN_KEY, VAL_KEY = 0, 1  # the second number of a sequence's key (lmlab.run.lit): its split
IGNORE = -100  # the loss's ignore_index (lmlab.model.loss): the positions mlm does not predict, padded targets
ACCURACY = "accuracy"  # classify's side-channel figure: train/accuracy, val/accuracy
Fraction = Annotated[float, Range(ge=0, le=1)]


def row_generator(key: Sequence[int]) -> torch.Generator:
    """A CPU generator seeded from a key of integers (numpy's SeedSequence mixes them: nearby keys give unrelated
    streams); the same key, the same draws on any machine."""
    words = np.random.SeedSequence([int(k) % 2**64 for k in key]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(words[0]) << 32 | int(words[1]))


class MaskedLM(nn.Module):
    """head=mlm: BERT's masked-token objective on a bidirectional model (module docstring)."""

    depth = 0
    weights: tuple[float, ...] = ()
    declared: dict[str, tuple[str, ...]] = {}
    causal = False  # every layer reads the whole text
    reserved = 1  # [MASK] = model.vocab_size - 1
    predicts_next = False
    draws = True  # `prepare` draws from each sequence's key
    objective = "masked_token"  # val/loss: the chosen positions' cross-entropy (summary.json's `objective`)

    def __init__(self, cfg: GPTConfig, *, mask_prob: Annotated[float, Range(gt=0, lt=1)] = 0.15,
                 mask_frac: Fraction = 0.8, random_frac: Fraction = 0.1) -> None:
        super().__init__()
        if mask_frac + random_frac > 1:
            raise ValueError(f"head.mask_frac={mask_frac} + head.random_frac={random_frac} > 1: of the chosen "
                             f"positions these fractions become [MASK] and a random token, the rest stay as they are")
        if cfg.vocab_size < 2:
            raise ValueError(f"model.vocab_size={cfg.vocab_size}: head=mlm needs a token besides [MASK]")
        self.mask_prob, self.mask_frac, self.random_frac = mask_prob, mask_frac, random_frac
        self.mask_id = cfg.vocab_size - 1  # the tokenizer's ids are 0 .. mask_id - 1
        self.vocab_size = self.mask_id

    @classmethod
    def n_params(cls, cfg: GPTConfig, **params: Any) -> int:
        return 0  # [MASK]'s row is in model.vocab_size

    def sample(self, keys: Sequence[Sequence[int]], T: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each sequence's draws from its key, on the CPU: the positions' order scores (B, T), the fate draws (B, T)
        and the random tokens (B, T)."""
        rows = []
        for key in keys:
            g = row_generator(key)
            rows.append((torch.rand(T, generator=g), torch.rand(T, generator=g),
                         torch.randint(0, self.vocab_size, (T,), generator=g)))
        return tuple(torch.stack(parts) for parts in zip(*rows))  # type: ignore[return-value]

    def prepare(self, idx: torch.Tensor, targets: torch.Tensor, keys: Sequence[Sequence[int]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch as the objective reads it: idx (B, T) with the chosen positions corrupted, and targets (B, T) the
        original tokens there, IGNORE elsewhere. `targets` are the data's next tokens, read only for padding (a padded
        row's, data.packing=padded: an input is padding where the target before it is IGNORE; padding is never
        chosen). `keys`: one key per sequence (`row_generator`)."""
        B, T = idx.shape
        score, fate, tokens = (t.to(idx.device) for t in self.sample(keys, T))
        real = torch.ones_like(idx, dtype=torch.bool)
        real[:, 1:] = targets[:, :-1] != IGNORE
        k = (real.sum(1) * self.mask_prob).round().clamp_min(1)  # (B,) positions to choose per sequence
        rank = score.masked_fill(~real, 2.0).argsort(1).argsort(1)  # each position's place in its row's random order
        chosen = rank < k[:, None]
        masked = chosen & (fate < self.mask_frac)
        randomised = chosen & (fate >= self.mask_frac) & (fate < self.mask_frac + self.random_frac)
        inputs = torch.where(masked, self.mask_id, torch.where(randomised, tokens, idx))
        return inputs, torch.where(chosen, idx, IGNORE)

    def logits(self, h: torch.Tensor, idx: torch.Tensor, lm_logits: Callable[[torch.Tensor], torch.Tensor]
               ) -> torch.Tensor:
        return lm_logits(h)

    def loss(self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor, lm_loss: Callable[..., Any],
             z_loss: float = 0.0, parts: bool = False) -> Any:
        return lm_loss(h, targets, z_loss=z_loss, parts=parts)  # IGNORE but at the chosen positions

    def terms(self, *args: Any) -> list[Term]:
        return []


class Classify(nn.Module):
    """head=classify: a pooled sequence classifier on a bidirectional model (module docstring)."""

    depth = 0
    weights: tuple[float, ...] = ()
    declared = {ACCURACY: ("train", "val")}
    causal = False
    reserved = 1  # [MASK] = model.vocab_size - 1, which data=labelled pads with (and the mlm run it starts from has)
    predicts_next = False
    draws = False
    objective = "label"  # val/loss: the label's cross-entropy
    params_group = "classify"  # the monitor's name for its weights (grad/norm/classify)

    def __init__(self, cfg: GPTConfig, *, labels: list[str] | None = None,
                 pool: Literal["mean", "first"] = "mean") -> None:
        super().__init__()
        if labels is None or len(labels) < 2 or len(set(map(str, labels))) != len(labels):
            raise ValueError(f"head.labels={labels}: head=classify needs two or more distinct label names, which "
                             f"data=labelled fills in from its file (or set head.labels=[...] yourself)")
        self.labels, self.pool, self.pad_id = [str(label) for label in labels], pool, cfg.vocab_size - 1
        self.out = nn.Linear(cfg.d_model, len(labels), bias=True)
        self._accuracy: torch.Tensor | None = None  # the last loss's, for `terms`

    @classmethod
    def n_params(cls, cfg: GPTConfig, *, labels: list[str] | None = None, **params: Any) -> int:
        return (cfg.d_model + 1) * len(labels or ())  # the label layer ([MASK]'s row is in model.vocab_size)

    def prepare(self, idx: torch.Tensor, targets: torch.Tensor, keys: Sequence[Sequence[int]]
                ) -> tuple[torch.Tensor, torch.Tensor]:
        return idx, targets

    def pooled(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """h (B, T, d) -> (B, d): the first token's state, or the mean over the tokens that are not padding."""
        if self.pool == "first":
            return h[:, 0]
        real = (idx != self.pad_id).to(h.dtype)[..., None]  # (B, T, 1)
        return (h * real).sum(1) / real.sum(1).clamp_min(1.0)

    def logits(self, h: torch.Tensor, idx: torch.Tensor, lm_logits: Callable[[torch.Tensor], torch.Tensor] | None
               ) -> torch.Tensor:
        """The label logits (B, n_labels) of normed hidden states h (B, T, d)."""
        return self.out(self.pooled(h, idx))

    def loss(self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor, lm_loss: Callable[..., Any] | None,
             z_loss: float = 0.0, parts: bool = False) -> Any:
        """The mean cross-entropy of the labels targets (B,), fp32 (z_loss on the label logits, if given)."""
        logits = self.logits(h, idx, None)
        self._accuracy = (logits.detach().argmax(-1) == targets).float().mean()
        return cross_entropy(logits, targets, z_loss=z_loss, parts=parts)

    def terms(self, *args: Any) -> list[Term]:
        """The last loss's accuracy, a figure (weight 0), logged in training and validation."""
        return [] if self._accuracy is None else [Term(ACCURACY, self._accuracy, 0.0, ("train", "val"))]
