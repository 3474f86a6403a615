"""attention.paired_heads: paired head attention, the GPT-2 speedrun's record 58 (2026-01-07, PR #191).

Heads pair up, h with h + n_head/2, and each pair reads both heads' keys in one softmax. The pair's queries, keys and
values are interleaved into a sequence twice as long, token t's first head (h < n_head/2) at slot 2t and its partner at
slot 2t + 1, and causal attention runs over the slots. For the member a ∈ {0, 1} of a pair at token t:

    y_{a,t} = Σ_{(b,s): 2s + b ≤ 2t + a} softmax_{(b,s)}(q_{a,t}·k_{b,s} / √d) · v_{b,s}

so a query reads two logits for every earlier token, one per head's key, in the same softmax; of its own token the
first head reads its own key and the second both. Everything positional counts slots, as in the record: the position
scheme rotates member a of token t at position 2t + a (the record's staggered rotary: the partner one step after, and
positions advancing twice per token); a window of W (attention.window / pattern) reads the last W slots, about W/2
tokens (the record kept its windows: "a window of 128 is really only looking at 64 positions back"); documents
(attention.doc_mask) and position.per_document count both slots of a token in its document.

Under GQA the key/value heads pair the same way (j with j + n_kv_head/2), so query pair j reads key/value pair
j // (n_head / n_kv_head): n_head and the key/value heads must both be even (attention=mqa is refused). The KV cache
holds keys and values per token, as without pairing, and they are interleaved when read (a windowed layer keeps its
last W − 1 tokens: more than W slots need). log-n scaling and softmax_plus's factor count the tokens a query reads;
score=relu2 divides by the slots. The monitor's weights (`paired_weights`) are folded back onto the tokens.

The record pairs 4 of its 11 layers, 0, 2, 5 and 9 (short-window layers without the key offset; more "kept getting
better"); `paired_heads=true` pairs every layer, a list of 0-based layers pairs those (the record's: [0, 2, 5, 9]).
One difference: the record rotates before it interleaves, head h at 2t + (h mod 2), while it interleaves h with
h + n_head/2, so with its 6 heads the pair (1, 4) has its stagger reversed (and an even n_head/2 would stagger no
pair); lmlab rotates each head at its slot, as the record's README describes. At n_head = 2 the two are the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from lmlab.model.attention.parts import Part
from lmlab.model.attention.score import Softmax, attend, explicit_weights
from lmlab.registry import NonNegativeInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.position import Position


def interleave(x: torch.Tensor) -> torch.Tensor:
    """(B, h, T, d) -> (B, h/2, 2T, d): head j + a·h/2 of token t at slot 2t + a of pair j."""
    B, h, T, d = x.shape
    return x.reshape(B, 2, h // 2, T, d).permute(0, 2, 3, 1, 4).reshape(B, h // 2, 2 * T, d)


def split(x: torch.Tensor) -> torch.Tensor:
    """`interleave`'s inverse: (B, h/2, 2T, d) -> (B, h, T, d)."""
    B, p, T2, d = x.shape
    return x.reshape(B, p, T2 // 2, 2, d).permute(0, 3, 1, 2, 4).reshape(B, 2 * p, T2 // 2, d)


def slots(doc: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token document numbers (B, T) -> per slot (B, 2T): both slots of a token in its document."""
    return None if doc is None else doc.repeat_interleave(2, dim=1)


def rotate_paired(pos: Position, q: torch.Tensor, k: torch.Tensor, offset: int, doc: torch.Tensor | None,
                  layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q (B, nh, T, d) and k (B, nkv, T, d) of tokens offset.. rotated at their slots' positions, 2t + a."""
    q, k = pos.rotate(interleave(q), interleave(k), 2 * offset, slots(doc), layer)
    return split(q), split(k)


def paired_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score: Softmax, scale: float, pos: Position,
                  offset: int, dropout_p: float, window: int | None, softcap: float | None,
                  docs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """`attend` over the interleaved slots: q (B, nh, T, d), k and v (B, nkv, S, d), the S tokens ending with the last
    query, -> (B, nh, T, dv); `docs` the queries' and keys' document numbers per token."""
    docs = None if docs is None else (slots(docs[0]), slots(docs[1]))
    y = attend(interleave(q), interleave(k), interleave(v), score, scale, pos, 2 * offset, dropout_p, window, softcap,
               docs)
    return split(y)


def paired_weights(q: torch.Tensor, k: torch.Tensor, score: Softmax, scale: float, pos: Position,
                   window: int | None, softcap: float | None, doc: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights (B, nh, T, T) of a whole text, folded onto the tokens (a head's weight on token s: the sum over s's
    two slots, so rows still sum to one), and each head's max logit (B, nh), from q (B, nh, T, d), k (B, nkv, T, d)."""
    qs, ks = interleave(q), interleave(k)
    ks = ks.repeat_interleave(qs.size(1) // ks.size(1), dim=1)
    weights, logits = explicit_weights(qs, ks, score, scale, pos, 0, window, softcap,
                                       None if doc is None else (slots(doc), slots(doc)))
    B, p, T2, _ = weights.shape
    T = T2 // 2
    folded = weights.reshape(B, p, T, 2, T, 2).sum(-1).permute(0, 3, 1, 2, 4).reshape(B, 2 * p, T, T)
    peak = logits.reshape(B, p, T, 2, T2).amax(dim=(2, 4)).transpose(1, 2).reshape(B, 2 * p)
    return folded, peak


def paired_layer(paired_heads: bool | list[int], layer: int, cfg: GPTConfig) -> bool:
    """Whether layer `layer` pairs its heads (`paired_heads`: true, every layer; a list, those 0-based layers),
    refusing by key what pairing cannot compose with: odd head counts, a position bias per head, and a dynamic
    rope_scaling (the keys one per head or per key, with no slot, are the part's `excludes`; an option that pairs its
    own way refuses the key, its `refuses`)."""
    layers = [] if isinstance(paired_heads, bool) else list(paired_heads)
    if paired_heads is not True and not layers:
        return False
    key = f"attention.paired_heads={'true' if paired_heads is True else layers}"
    if outside := [i for i in layers if not 0 <= i < cfg.n_layer]:
        raise ValueError(f"{key}: {outside} are not layers of model.n_layer={cfg.n_layer} (0-based: 0 .. "
                         f"{cfg.n_layer - 1})")
    if cfg.n_head % 2:
        raise ValueError(f"{key} pairs head h with head h + n_head/2: model.n_head={cfg.n_head} must be even")
    if cfg.kv_heads % 2:
        raise ValueError(f"{key} pairs the key/value heads as the query heads, so their number must be even (got "
                         f"{cfg.kv_heads}); use attention=mha, or attention=gqa with an even model.n_kv_head "
                         f"(attention=mqa has 1)")
    from lmlab.model.position import POSITIONS, ROPE_SCALINGS, Position

    name = cfg.position.get("name")
    scheme = POSITIONS.get(name)
    if scheme is not None and (scheme.attn_bias is not Position.attn_bias
                               or scheme.score_bias is not Position.score_bias):
        raise ValueError(f"{key} with position={name}: its logit bias is per head, and a pair's softmax mixes two "
                         f"heads' keys; use position=rope (the record's), xpos, none or an absolute scheme")
    scaling = cfg.rope_scaling.get("name")
    if getattr(scheme, "accepts_scaling", False) and getattr(ROPE_SCALINGS.get(scaling), "dynamic", False):
        raise ValueError(f"{key} rotates at the slots' positions (twice the tokens'), where rope_scaling={scaling} "
                         f"picks its frequencies from a length that the KV cache counts in tokens; use a static "
                         f"rope_scaling (none, linear, ntk, yarn, ...)")
    return paired_heads is True or layer in layers


class PairedHeads(Part):
    rank = 8
    excludes = dict.fromkeys(("sinks", "forget_gate", "mem_kv"), "a pair's keys are read in one softmax over its two "
                             "heads' slots, where a key one per head, or keys without a slot, have no form; leave it "
                             "at its default")

    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, paired_heads: bool | list[NonNegativeInt] = False) -> None:
        self.here = paired_layer(paired_heads, attn.layer, cfg)
        if self.here:
            attn.no_qk_clip = "attention.paired_heads: a logit of a pair is one head's query against the other's key"

    def rotation(self, attn: nn.Module, pos: Position, q: torch.Tensor, k: torch.Tensor, offset: int,
                 doc: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return rotate_paired(pos, q, k, offset, doc, attn.layer)  # at the slots' positions, 2t and 2t + 1

    def attend(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, pos: Position,
               offset: int, docs: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        return paired_attend(q, k, v, attn.score, scale, pos, offset, attn.dropout if attn.training else 0.0,
                             attn.window, attn.softcap, docs)

    def token_weights(self, attn: nn.Module, q: torch.Tensor, k: torch.Tensor, pos: Position,
                      doc: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's two slots summed."""
        return paired_weights(q, k, attn.score, scale, pos, attn.window, attn.softcap, doc if attn.doc_mask else None)


PARTS = {"paired_heads": PairedHeads}
