"""attention=talking_heads: talking-heads attention (Shazeer et al., 2020, "Talking-Heads Attention"). The heads
exchange information around the softmax through two learned h × h mixes, of the logits before it (P_l) and of the
weights after it (P_w):

    L'_h = Σ_g P_l[h, g] · q_g k_gᵀ / √d        W = softmax(L' + mask)        W'_h = Σ_g P_w[h, g] · W_g
    out_h = W'_h · v_h

Each mix is the identity plus a learned h × h matrix that starts at zero, so the layer is MHA at initialisation and
weight decay pulls it back toward MHA, not toward zero. The mixed logits are one dot product per head over all heads'
keys, q'_h = [P_l[h, 0]·q_0; …; P_l[h, h−1]·q_{h−1}] against k' = [k_0; …; k_{h−1}] (width h·d), so the masks,
windows, documents, softcap and the KV cache are MHA's. Explicit: every head's (T, S) weights are held.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.model.attention.mha import MHA, Geometry
from lmlab.model.attention.score import explicit_weights

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.position import Position


class TalkingHeads(MHA):
    """MHA with the logits and the weights mixed across heads (`lmlab.model.attention.talking`); every MHA key."""

    no_qk_clip = "its logits are mixed across heads before the softmax: a head's own scale is not its mixed logit's"
    runs_hooks = MHA.runs_hooks - {"extras", "select", "attend", "token_weights"}  # its own weights (`mix`, `probs`)
    refuses = {"paired_heads": "attention=talking_heads mixes the heads' logits over one key axis per head, which "
                               "pairing merges",
               "sinks": "attention=talking_heads mixes the heads' weights, where a sink logit per head has no place",
               **dict.fromkeys(("forget_gate", "mem_kv"), "attention=talking_heads mixes the heads' logits over one "
                               "key axis, where a head's forget gate or memory keys have no place")}

    def __init__(self, cfg: GPTConfig, layer: int = 0, **shared: Any) -> None:
        super().__init__(cfg, layer, **shared)
        self.logit_mix = nn.Parameter(torch.zeros(self.n_head, self.n_head))  # P_l − I
        self.weight_mix = nn.Parameter(torch.zeros(self.n_head, self.n_head))  # P_w − I

    @classmethod
    def geometry(cls, cfg: GPTConfig, **params: Any) -> Geometry:
        mha = MHA.geometry(cfg, **params)
        nh, hd = cfg.n_head, cfg.head_dim
        return dataclasses.replace(mha, attn_width=nh * nh * hd + nh * hd, n_params=mha.n_params + 2 * nh * nh)

    def weights(self, q: torch.Tensor, k: torch.Tensor, pos: Position, offset: int,
                docs: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixed weights W' (B, h, T, S) and the mixed, masked logits, from q (B, h, T, d) and k (B, hkv, S, d)."""
        B, nh, T, d = q.shape
        k = k.repeat_interleave(nh // k.size(1), dim=1)  # (B, h, S, d)
        p_l = self.logit_mix + torch.eye(nh, dtype=q.dtype, device=q.device)
        q_mixed = (p_l[None, :, :, None, None] * q[:, None]).permute(0, 1, 3, 2, 4).reshape(B, nh, T, nh * d)
        k_all = k.permute(0, 2, 1, 3).reshape(B, 1, -1, nh * d).expand(B, nh, -1, nh * d)
        w, logits = explicit_weights(q_mixed, k_all, self.score, self.scale, pos, offset, self.window, self.softcap,
                                     docs, heads=(q, k))  # a bias from q and k (CoPE's): each head's own
        p_w = self.weight_mix + torch.eye(nh, dtype=w.dtype, device=w.device)
        return torch.einsum("hg,bgts->bhts", p_w, w), logits

    def mix(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: Position, offset: int,
            docs: tuple[torch.Tensor, torch.Tensor] | None, extras: dict[str, Any], scale: float | None = None
            ) -> torch.Tensor:
        w, _ = self.weights(q, k, pos, offset, docs)
        if self.training and self.dropout:
            w = torch.nn.functional.dropout(w, self.dropout)
        return w @ v.repeat_interleave(q.size(1) // v.size(1), dim=1)

    @property
    def sums_to_one(self) -> bool:
        return False  # P_w's rows are learned: a mixed row need not sum to one

    def probs(self, x: torch.Tensor, pos: Position, doc: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = self.qkv(x, pos, 0, doc, mix=False)
        w, logits = self.weights(q, k, pos, 0, (doc, doc) if self.doc_mask else None)
        return w, logits.amax(dim=(-2, -1))


OPTIONS = {"talking_heads": TalkingHeads}
