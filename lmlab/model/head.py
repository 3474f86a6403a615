"""What the model predicts (the `head` axis): `next` (the next token only, every earlier run), `mtp`, multi-token
prediction, which trains extra modules to predict the tokens after it, `prefix` (lmlab.model.prefix: the next token
and each target's longest prefix token from the same logits, the GPT-2 speedrun's auxiliary loss), `mtp_logits`
(lmlab.model.mtp_logits: the same logits scored on the tokens after the next, the speedrun's parameter-free MTP), and
the encoder objectives of `lmlab.model.encoder`: `mlm` (a bidirectional masked language model) and `classify` (a
sequence classifier).

Contract: `Head(cfg, *, <own params>)`, an nn.Module built once per model, with `depth` (the extra tokens predicted;
0: none) and `terms(h, idx, targets, doc, embed, pos, lm_loss)`: its side-channel terms (lmlab.model.side; MTP's
depths' losses [L_1, ..., L_D], with `losses`, from the trunk's final hidden state h (B, T, d) before the final norm,
given the tokens idx and the next-token targets (B, T); `weights`, the weights its terms take in the objective: each
depth's, head=prefix's one). Besides:
- `causal`: whether every layer reads only the keys at or before a query (the model sets it on its position scheme,
  which every attention path reads; False: bidirectional, and what cannot read both ways is refused by key);
- `reserved`: ids past the tokenizer's that the model embeds ([MASK] = vocab_size for the encoder heads; 0 here);
- `predicts_next`: whether the output head's logits are next-token predictions (what generation, the KV cache,
  eval.py's per-position loss and export=hf read; the others refuse a head without); `objective`: what its loss
  is, as summary.json names it (next_token; masked_token, label);
- `prepare(idx, targets, keys)`: the batch as the objective reads it (the training loop's and validation's), here
  as it is; `draws`: whether it draws random numbers, from `keys`, one per sequence (head=mlm's masks);
- `logits(h, idx, lm_logits)` and `loss(h, idx, targets, lm_loss, z_loss, parts)`: the model's output from the
  normed final hidden states, here the output head's logits and token loss (`lm_logits(h)`, `lm_loss(h, targets)`:
  the model's own output head, softcap, µP's readout multiplier, chunked or not: the shared unembedding).

`mtp` (DeepSeek-V3, 2024, §2.2: "sequential" modules; or Gloeckle et al., 2024, "Better & Faster Large Language Models
via Multi-token Prediction": "parallel" heads) with depth D. At depth k the target of position i is t_{i+k+1}, so the
last k positions have none and are dropped:

    sequential  h⁰ = h,  hᵏ_i = TRM_k(M_k [RMSNorm(hᵏ⁻¹_i); RMSNorm(Emb(t_{i+k}))])   i < T − k
    parallel    hᵏ_i = TRM_k(h_i)                                                     i < T − k
    L_k = CE(OutHead(Norm_k(hᵏ_i)), t_{i+k+1}),   objective = L_next + Σ_k w_k·L_k,  w_k = weight / D (DeepSeek's λ/D)
    unless `weights` gives one per depth.

TRM_k is one block of the model's placement and block kind (the last layer's settings: its window, its position
rules), the norms are the model's norm group, M_k a d × 2d projection, Emb and OutHead the model's own (shared, as
both papers do). The trunk is the whole model, so the next-token logits, generation and evaluation are those of a
model without the head (eval.py reports the next-token loss; the extra depths' losses are logged apart,
`train/mtp_loss_k` and `val/mtp_loss_k`); Gloeckle et al. instead branch their heads off the trunk's last layer, which
would make the next-token path one of n equal heads: here it stays the model every other option is compared as.
The residual options shape the trunk only: each MTP block is wired by the placement alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from lmlab.model.block import BLOCKS
from lmlab.model.capabilities import FitsVocabulary
from lmlab.model.encoder import Classify, MaskedLM
from lmlab.model.mtp_logits import MTPLogits
from lmlab.model.next_token import NextToken
from lmlab.model.norm import NORMS
from lmlab.model.placement import PLACEMENTS
from lmlab.model.prefix import PrefixToken
from lmlab.model.side import Term
from lmlab.registry import NonNegativeFloat, PositiveInt, build, option_params, option_types

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.position import Position

LMLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


MTP_LOSS = "mtp_loss_"  # the depths' side-channel terms (lmlab.model.side): <split>/mtp_loss_<k>, before weights


class MTP(NextToken):
    def __init__(self, cfg: GPTConfig, *, depth: PositiveInt = 1, style: Literal["sequential", "parallel"] =
                 "sequential", weight: NonNegativeFloat = 0.3, weights: list[float] | None = None) -> None:
        super().__init__(cfg)
        if weights is not None and (len(weights) != depth or any(w < 0 for w in weights)):
            raise ValueError(f"head.weights={list(weights)} must give one weight >= 0 per depth (head.depth={depth}), "
                             f"or be null for head.weight / depth each")
        if depth >= cfg.max_seq_len:  # at depth k position i predicts t_{i+k+1}: no position has a target then
            raise ValueError(f"head.depth={depth} must be less than model.max_seq_len={cfg.max_seq_len} (the context): "
                             f"the depth-k module predicts the token k+1 positions further, so a depth of the "
                             f"context or more leaves it no position with a target")
        self.depth, self.style = depth, style
        self.weights = tuple(float(w) for w in weights) if weights is not None else (weight / depth,) * depth
        last = cfg.n_layer - 1  # each module's block takes the last layer's settings
        self.blocks = nn.ModuleList(build("placement", PLACEMENTS, cfg.placement, cfg, last) for _ in range(depth))
        self.norms = nn.ModuleList(build("norm", NORMS, cfg.norm, cfg.d_model) for _ in range(depth))
        if style == "sequential":
            self.norm_h = nn.ModuleList(build("norm", NORMS, cfg.norm, cfg.d_model) for _ in range(depth))
            self.norm_e = nn.ModuleList(build("norm", NORMS, cfg.norm, cfg.d_model) for _ in range(depth))
            self.proj = nn.ModuleList(nn.Linear(2 * cfg.d_model, cfg.d_model, bias=cfg.bias) for _ in range(depth))

    @classmethod
    def n_params(cls, cfg: GPTConfig, *, depth: int = 1, style: str = "sequential", **_) -> int:
        """Its weights from the sizes alone (the size bounds): a block per depth, and M_k's 2d² when sequential."""
        per = build("block", BLOCKS, cfg.block, cfg).n_params(cfg.n_layer - 1) + (2 * cfg.d_model ** 2 if style == "sequential" else 0)
        return depth * per

    @property
    def declared(self) -> dict[str, tuple[str, ...]]:
        """The terms it records (lmlab.model.side): each depth's loss, logged in training and validation."""
        return {f"{MTP_LOSS}{k}": ("train", "val") for k in range(1, self.depth + 1)}

    def terms(self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor, doc: torch.Tensor | None,
              embed: nn.Module, pos: Position, lm_loss: LMLoss) -> list[Term]:
        """`losses` as side-channel terms, each with its weight in the objective."""
        return [Term(f"{MTP_LOSS}{k}", v, w, ("train", "val"))
                for k, (w, v) in enumerate(zip(self.weights, self.losses(h, idx, targets, doc, embed, pos, lm_loss),
                                               strict=False), 1)]

    def losses(self, h: torch.Tensor, idx: torch.Tensor, targets: torch.Tensor, doc: torch.Tensor | None,
               embed: nn.Module, pos: Position, lm_loss: LMLoss) -> list[torch.Tensor]:
        T = idx.size(1)
        out, prev = [], h
        for k in range(1, min(self.depth, T - 1) + 1):
            n = T - k  # positions with a target k + 1 tokens ahead
            if self.style == "sequential":
                x = torch.cat((self.norm_h[k - 1](prev[:, :n]), self.norm_e[k - 1](embed(idx[:, k:]))), dim=-1)
                x = self.proj[k - 1](x)
            else:
                x = h[:, :n]
            prev = self.blocks[k - 1](x, pos, None, None if doc is None else doc[:, :n])
            out.append(lm_loss(self.norms[k - 1](prev), targets[:, k:]))
        return out


HEADS = {"next": NextToken, "mtp": MTP, "mtp_logits": MTPLogits, "prefix": PrefixToken, "mlm": MaskedLM,
         "classify": Classify}


def fit_head(spec: dict[str, Any], labels: Sequence[str] | None, data: str | None) -> tuple[dict[str, Any], int]:
    """The head's spec fitted to the data `data` (its name, for the messages): a labelled set's label names (`labels`,
    data=labelled's) become head=classify's `labels`, refused by key for a head without them or a head with them and
    no labelled set. Returns the spec and the ids the head reads past the tokenizer's (`reserved`), which the model's
    vocabulary adds to the tokenizer's."""
    name, _ = option_params("head", HEADS, spec)
    takes = "labels" in option_types(HEADS[name])
    if labels is not None and not takes:
        raise ValueError(f"data={data} is a labelled set (texts and their labels): train a classifier on it with "
                         f"head=classify, not head={name}")
    if takes and labels is None:
        raise ValueError(f"head={name} learns labels: it needs a labelled set, data=labelled data.path=<a JSONL file "
                         f"of text and label lines> (python -m lmlab.data.labelled builds one), not data={data}")
    if labels is not None:
        if spec.get("labels") is not None and [str(x) for x in spec["labels"]] != list(labels):
            raise ValueError(f"head.labels={spec['labels']} but the data's labels are {list(labels)}: leave "
                             f"head.labels=null (the data's are taken)")
        spec = {**spec, "labels": list(labels)}
    return spec, HEADS[name].reserved


def fit_vocabulary(spec: dict[str, Any], tokenizer: Any, vocab_size: int, eod_id: int | None, data: str | None
                   ) -> dict[str, Any]:
    """The head's spec fitted to the data's tokenizer (`tokenizer`, None for data without one; the model's
    `vocab_size`, the data's end-of-document `eod_id`, `data` its name for the messages): a head that reads the
    vocabulary (its `fit_vocabulary`: head=prefix's prefix table, lmlab.model.prefix) takes what it needs, refused by
    key when the vocabulary cannot give it; the others are returned as they are. Kept in the model record, not the
    run's config (as the data's eod_id is)."""
    name, _ = option_params("head", HEADS, spec)
    head = HEADS[name]
    if not isinstance(head, FitsVocabulary):
        return dict(spec)
    return head.fit_vocabulary(spec, tokenizer, vocab_size, eod_id, data)
