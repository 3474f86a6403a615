"""QK-clip (Kimi Team, 2025, "Kimi K2", MuonClip's clip): keep every head's attention logits under a threshold τ by
rescaling its query and key weights after the optimizer step, not by changing the loss or the forward.

At each step, per attention head h, S_h = max over the batch's queries and keys of the logit q·k/√d (the max logit the
monitor logs, here at every step, from the step's own inputs and the weights that computed them). After the optimizer
step, every head with S_h > τ has its logits scaled by γ_h = τ / S_h through its weights (the attention option's
`clip_logits`: √γ_h on W_q's and W_k's rows for MHA; a key head shared by a GQA group takes √min γ and each query head
the rest; MLA: √γ_h on q_nope's and k_nope's rows, γ_h on q_rope's, the rotary key all heads share untouched);
heads at or under τ are untouched. It bounds the logits the next step starts from, whatever the optimizer (the
paper pairs it with Muon; it works with any).

`optim.qk_clip=τ` (a loop key; null: off; Kimi K2 used τ = 100). The figures at every step: `attn/qk_clipped_heads`
(how many heads were rescaled) and `attn/qk_max_logit` (the largest S_h, before the clip). Each step re-runs the q and
k projections of the last micro-batch and its (T × T) logits per head (no grad): a cost like the monitor's, every step.
Refused before training, naming the key: an attention option whose logits a per-head scale cannot bound
(`no_qk_clip`), q/k norms (they undo the scale), trainer=fsdp2 (the rows of a sharded weight), block=gau.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lmlab.optim.capabilities import ClipsLogits


def gammas(max_logits: torch.Tensor, threshold: float) -> torch.Tensor:
    """γ_h = min(1, τ / S_h) per head: exactly 1 for a head at or under τ (`τ / S` as torch computes it for a Python
    τ, S's reciprocal times τ, can be one ulp under 1 where S = τ)."""
    over = max_logits > threshold
    return torch.where(over, max_logits.new_tensor(threshold) / torch.where(over, max_logits, 1.0), 1.0)


def attention_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """(layer index, attention sublayer) for every block with one (a hybrid stack's recurrent layers have none)."""
    out = []
    for i, block in enumerate(model.h):
        for attr in block.sublayer_names:
            module = getattr(block, attr)
            if isinstance(module, ClipsLogits):
                out.append((i, module))
                break
    return out


def check_qk_clip(optim: dict, model: nn.Module, attention: str, strategy: str | None = None) -> None:
    """Refuse optim.qk_clip where it would do nothing or the wrong thing, naming the key (before training; `model`:
    on the meta device; `attention`: the attention option's name)."""
    tau = optim.get("qk_clip")
    if tau is None:
        return
    if strategy == "FSDP2Strategy":
        raise ValueError(f"optim.qk_clip={tau} with trainer=fsdp2: the clip rescales rows of W_q and W_k, which FSDP2 "
                         f"shards; use trainer=ddp, or optim.qk_clip=null")
    if why := model.pos.logit_bias:  # the max would count the bias W_q, W_k lack
        raise ValueError(f"optim.qk_clip={tau} with {why}: the measured maximum logit includes that bias while the "
                         f"clip rescales only W_q and W_k, so it would shrink them every step without bounding the "
                         f"logits; use position=rope|none|learned, or optim.qk_clip=null")
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"optim.qk_clip={tau}: the model has no attention layer to clip (block=gau, or every "
                         f"mixer.pattern entry recurrent); use optim.qk_clip=null")
    for _, attn in layers:
        if reason := attn.no_qk_clip:
            raise ValueError(f"optim.qk_clip={tau} with attention={attention}: {reason}; use attention=mha|gqa|mqa, "
                             f"or optim.qk_clip=null")
        if dict(attn.named_parameters(recurse=False)).get("q_norm") is not None:  # attention.qk_norm's gains
            raise ValueError(f"optim.qk_clip={tau} with attention.qk_norm=true: the q/k norms undo any scale of W_q "
                             f"and W_k (and bound the logits already); use one of the two")


class QKClip:
    """The clip over a model: `record` its attention inputs (forward pre-hooks), `measure` each head's max logit with
    the weights that saw them, `clip` after the step. `reduce_max`: a max over ranks (DDP: every rank must apply the
    same γ to weights that are the same)."""

    def __init__(self, model: nn.Module, threshold: float, reduce_max: Callable[[torch.Tensor], torch.Tensor]
                 = lambda t: t) -> None:
        self.model, self.threshold, self.reduce_max = model, float(threshold), reduce_max
        self.layers = attention_layers(model)
        self.recording = False
        self.inputs: dict[int, tuple[torch.Tensor, Any]] = {}
        self.max_logits: torch.Tensor | None = None  # (layers, n_head) of the step measured
        self._hooks = [attn.register_forward_pre_hook(self._hook(i), with_kwargs=True) for i, attn in self.layers]

    def _hook(self, i: int):
        def hook(module, args, kwargs):
            if self.recording and module.training:
                self.inputs[i] = (args[0].detach(), kwargs.get("doc"))
        return hook

    @torch.no_grad()
    def measure(self) -> None:
        """S (layers, n_head): each head's max logit over the recorded batch, the max over ranks."""
        rows = []
        for i, attn in self.layers:
            if i not in self.inputs:
                self.max_logits = None
                return
            x, doc = self.inputs[i]
            rows.append(attn.probs(x, self.model.pos, doc)[1].amax(dim=0).float())  # (n_head,)
        self.inputs = {}
        self.max_logits = self.reduce_max(torch.stack(rows)) if rows else None

    @torch.no_grad()
    def clip(self) -> dict[str, float]:
        """Rescale the heads over τ (after the optimizer step); the step's figures."""
        if self.max_logits is None:
            return {}
        from lmlab import names

        gamma = gammas(self.max_logits, self.threshold)
        for (_, attn), g in zip(self.layers, gamma, strict=True):
            if bool((g < 1).any()):
                attn.clip_logits(g)
        figures = {names.QK_CLIPPED_HEADS: float((gamma < 1).sum()), names.QK_MAX_LOGIT: float(self.max_logits.max())}
        self.max_logits = None
        return figures

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
