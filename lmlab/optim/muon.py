"""Muon (Jordan et al., 2024, "Muon: an optimizer for hidden layers"): orthogonalised momentum for the hidden matrices,
AdamW for everything else, in one optimizer object (the form Lightning, the LR schedule and checkpoints expect).

Per hidden matrix W (m × n), with g its gradient (torch.optim.Muon's step, which this runs):

    B ← μ·B + (1 − μ)·g;   U = (1 − μ)·g + μ·B  (nesterov) or B;   O = NS₅(U) ≈ U·(UᵀU)^(−½)
    W ← W·(1 − lr·wd) − lr·s(m, n)·O

NS₅ is five steps of the quintic Newton–Schulz iteration X ← aX + (bA + cA²)X, A = XXᵀ, from X = U/‖U‖_F, in bf16,
coefficients (a, b, c) = (3.4445, −4.775, 2.0315) (`newton_schulz`); it pushes U's singular values towards 1 without
an SVD. s(m, n) is the learning-rate scale convention (`adjust_lr_fn`): `match_rms_adamw` (default here, Moonlight,
Liu et al. 2025) s = 0.2·√max(m, n), which gives the update the RMS of AdamW's (≈ 0.2), so `lr` and `weight_decay` are
on AdamW's scale; `original` (Keller Jordan's) s = √max(1, m/n), for which lr ≈ 0.02 is typical.

Which tensors: the `hidden` role of `lmlab.optim.param_groups` (every 2-D weight of a Linear inside the blocks:
attention, FFN, GAU, gates, an MoE's experts); embeddings, the LM head (`is_readout`),
norm gains and biases go to AdamW at `adam_lr` (Muon is defined for hidden layers only: the head and embeddings are
not "hidden" maps between two wide spaces). Groups without a role (library use) go to Muon when every tensor is 2-D.

An MoE stores its E experts' matrices stacked in one Linear weight (E·m, n) (lmlab.model.moe.Experts): those come in
groups of their own (`experts` = E, kind `muon_experts`) and each expert's (m, n) matrix is orthogonalised on its own,
with its own s(m, n), by one batched Newton–Schulz over the (E, m, n) view (`ExpertMuon`; torchtitan's and Dion's
treatment of expert weights). The stack as one matrix would couple the experts' updates: an expert that gets few
tokens would take its step size from the others' gradients.

Momentum warm-up (modded-nanogpt): μ rises linearly from `momentum_start` to `momentum` over `momentum_warmup_steps`.
Under FSDP2 each rank holds row shards of W, and NS needs the whole matrix: lmlab refuses optim=muon with trainer=fsdp2
(lmlab.optim.validate_optim) rather than gather every matrix on every rank. DDP needs nothing: each rank holds the
whole matrices and the all-reduced gradients, and NS is deterministic, so every rank takes the same step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from lmlab.optim.cautious import cautious_step

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


MUON_KINDS = ("muon", "muon_experts")  # the groups the momentum warm-up applies to


def newton_schulz(g: torch.Tensor, steps: int = 5, coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = 1e-7) -> torch.Tensor:
    """The quintic Newton–Schulz iteration on a 2-D matrix, as torch.optim.Muon computes it (bf16; a tall matrix is
    transposed so that A = XXᵀ is the small Gram matrix), or on each matrix of an (E, m, n) stack at once (batched
    matmuls; each matrix's result is the 2-D one's)."""
    a, b, c = coefficients
    x = g.bfloat16()
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)  # spectral norm <= Frobenius norm = 1
    mm = torch.addmm if x.dim() == 2 else torch.baddbmm
    for _ in range(steps):
        A = x @ x.mT
        B = mm(A, A, A, beta=b, alpha=c)  # bA + cA², in torch's order (bf16 rounds each op)
        x = mm(x, B, x, beta=a)  # aX + BX
    return x.mT if tall else x


def lr_scale(adjust_lr_fn: str | None, m: int, n: int) -> float:
    """s(m, n) of an (m, n) matrix, torch.optim.Muon's conventions (None: `original`)."""
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(m, n))
    return math.sqrt(max(1, m / n)) if adjust_lr_fn in (None, "original") else 1.0


class ExpertMuon(torch.optim.Optimizer):
    """torch.optim.Muon's step for weights that stack `experts` matrices row-wise ((E·m, n), the group's `experts`
    key): momentum on the whole tensor (the same buffer layout), then Newton–Schulz and the lr scale per expert."""

    def __init__(self, params: Iterable, lr: float, momentum: float, nesterov: bool, ns_steps: int,
                 adjust_lr_fn: str | None, weight_decay: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn, weight_decay=weight_decay, eps=1e-7,
                                      ns_coefficients=NS_COEFFICIENTS))

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for g in self.param_groups:
            E, mu = g["experts"], g["momentum"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if g["nesterov"] else buf
                m, n = p.size(0) // E, p.size(1)
                o = newton_schulz(update.view(E, m, n), g["ns_steps"], g["ns_coefficients"], g["eps"])  # (E, m, n)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                p.add_(o.reshape(p.shape), alpha=-g["lr"] * lr_scale(g["adjust_lr_fn"], m, n))
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two kinds of groups (`kind`: "muon" or "adamw"); each kind is stepped by torch's own
    optimizer, which shares this object's param groups and state, so `state_dict()`/`load_state_dict()` are torch's:
    one state per parameter, every group's hyper-parameters (and the momentum warm-up's step count) in its dict."""

    def __init__(self, groups: Iterable[dict], *, lr: float, adam_lr: float, momentum: float, nesterov: bool,
                 ns_steps: int, adjust_lr_fn: str, betas: tuple[float, float], eps: float, cautious_wd: bool,
                 momentum_warmup_steps: int, momentum_start: float, fused: bool | None = None,
                 adamw: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW) -> None:
        """`adamw(groups, lr=, betas=, eps=, fused=)` builds the AdamW half (lmlab.optim passes its own: the fused
        kernel picked, cautious decay honoured)."""
        muon_groups, expert_groups, adam_groups = [], [], []
        for g in groups:
            params = list(g["params"])
            if not params:
                continue
            role = g.get("role", "hidden" if all(p.dim() == 2 for p in params) else "other")
            kind = adam_groups if role != "hidden" else expert_groups if g.get("experts", 1) > 1 else muon_groups
            kind.append({**g, "params": params, "cautious": cautious_wd})
        children = []
        for kind, builder, kind_groups in (("muon", torch.optim.Muon, muon_groups),
                                           ("muon_experts", ExpertMuon, expert_groups)):
            if not kind_groups:
                continue
            children.append(builder(kind_groups, lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                    adjust_lr_fn=adjust_lr_fn))
            for g in children[-1].param_groups:
                g.update(kind=kind, momentum_target=momentum, momentum_start=momentum_start,
                         momentum_warmup_steps=momentum_warmup_steps, muon_step=0)
        if adam_groups:
            children.append(adamw(adam_groups, lr=adam_lr, betas=betas, eps=eps, fused=fused))
            for g in children[-1].param_groups:
                g["kind"] = "adamw"
        self._children = {g["kind"]: child for child in children for g in child.param_groups}
        super().__init__([g for child in children for g in child.param_groups], {})
        self._link()

    def _link(self) -> None:
        """Let each kind's optimizer see this object's groups and state (again after load_state_dict replaced them)."""
        for kind, child in self._children.items():
            child.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            child.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for g in self.param_groups:
            if g["kind"] in MUON_KINDS:  # the momentum warm-up: μ_t from momentum_start to momentum over the steps
                w = g["momentum_warmup_steps"]
                frac = min(1.0, g["muon_step"] / w) if w else 1.0
                g["momentum"] = g["momentum_start"] + frac * (g["momentum_target"] - g["momentum_start"])
                g["muon_step"] += 1
        cautious_step(self, lambda: [child.step() for child in self._children.values()])
        return loss
