"""SOAP (Vyas et al., ICLR 2025, "SOAP: Improving and Stabilizing Shampoo using Adam"): Adam run in the eigenbasis of
Shampoo's preconditioner, which rotates the gradient so that Adam's per-coordinate second moment sees the directions
the gradients actually vary along. For a matrix W (m × n) with gradient G, at Adam step t (1-based):

    L ← β_s·L + (1 − β_s)·G·Gᵀ,   R ← β_s·R + (1 − β_s)·Gᵀ·G              (Shampoo's statistics, m × m and n × n)
    G' = Q_Lᵀ·G·Q_R                                                      (the gradient in the eigenbasis)
    M ← β1·M + (1 − β1)·G                                               (the first moment, kept in W's own basis)
    V ← β2·V + (1 − β2)·G'²                                             (the second moment, in the eigenbasis)
    N = Q_L·((Q_Lᵀ·M·Q_R) / (√V + ε))·Q_Rᵀ                              (Adam's direction, rotated back)
    W ← (W − lr·√(1 − β2^t)/(1 − β1^t)·N)·(1 − lr·wd)                   (bias correction, decoupled decay)

Q_L, Q_R are the eigenvectors of L and R (eigenvalues descending): an eigendecomposition of the first step's
statistics, then every `precondition_frequency` steps one power-iteration step and a QR decomposition warm-started
from the previous basis, Q ← qr(L·Q), its columns sorted by the Rayleigh quotients diag(Qᵀ·L·Q) and V's rows (columns
for R) permuted to match. L and R are updated with G after the step that used them (the authors' order), and the very
first step only measures: it fills L, R and their bases (and decays W) without moving W by its gradient, so that a
basis is never fitted to the gradient it rotates.

A dimension larger than `max_precond_dim` keeps the identity on its side (Q = I, no statistics): an embedding table's
vocabulary side (50k rows) is not preconditioned, its d_model side is. Tensors that are not matrices (norm gains,
biases, scalars) take plain Adam in this form (no rotation, the same step size and decay). Tensors of more than two
dimensions are treated as the reference does, one statistic per dimension (lmlab has none). An MoE's stacked experts
(one (E·m, n) Linear weight) are one matrix here: their rows are rotated together.

The reference is the authors' code (github.com/nikhilvyas/SOAP, soap.py at a1e5535; no package): the tests run
pytorch_optimizer's port of it side by side (tests/unit/optim/test_soap.py), and the authors' own file agreed within
6e-7 in fp32 over twelve steps when tried once. The authors keep M in the rotated basis and rotate it along with every
change of basis, which gives the same numbers as M kept in W's basis and rotated when used (Q is orthogonal); their
eigh and QR run in fp32, these in the parameter's precision (fp32 at least). Differences by design: the first step
applies the decay (lmlab's contract: a zero-gradient step is θ·(1 − lr·wd) for every optimizer; the reference's first
step leaves θ as it is); `shampoo_beta` is a number of its own, 0.95 by default as the reference's β2 (its −1 meaning
"β2" is not taken). Its `merge_dims`, `precondition_1d` and `normalize_grads` options are off, as in its defaults.
Per m × n matrix the state is 2·m·n + 2·m² + 2·n² numbers (M, V; L, Q_L; R, Q_R).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated

import torch

from lmlab.optim.capabilities import declare
from lmlab.optim.elementwise import Elementwise
from lmlab.registry import PositiveFloat, PositiveInt, Range

Beta = Annotated[float, Range(ge=0, lt=1)]
Betas = Annotated[tuple[float, float], Range(ge=0, lt=1)]


def rotate(x: torch.Tensor, bases: list[torch.Tensor | None], back: bool = False) -> torch.Tensor:
    """Each dim i of `x` into its basis bases[i] (None: left as is): a matrix's Q_Lᵀ·X·Q_R, or back, Q_L·X·Q_Rᵀ."""
    for q in bases:  # contract dim 0 with its basis and put the result last: after every dim, the order is x's again
        x = x.movedim(0, -1) if q is None else torch.tensordot(x, q, dims=([0], [1 if back else 0]))
    return x


def eigenbasis(stat: torch.Tensor) -> torch.Tensor:
    """The eigenvectors of a symmetric statistic, as columns, eigenvalues descending (the reference's +1e-30·I keeps an
    all-zero statistic decomposable; fp64 if the decomposition fails in a lower precision)."""
    eye = torch.eye(stat.shape[0], device=stat.device, dtype=stat.dtype)
    try:
        q = torch.linalg.eigh(stat + 1e-30 * eye).eigenvectors
    except torch.linalg.LinAlgError:
        q = torch.linalg.eigh(stat.double() + 1e-30 * eye.double()).eigenvectors.to(stat.dtype)
    return q.flip(1)


class SOAP(Elementwise):
    def __init__(self, params: Iterable, lr: float = 3e-3, betas: tuple[float, float] = (0.95, 0.95),
                 shampoo_beta: float = 0.95, eps: float = 1e-8, precondition_frequency: int = 10,
                 max_precond_dim: int = 10000, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps,
                                      precondition_frequency=precondition_frequency, max_precond_dim=max_precond_dim,
                                      weight_decay=weight_decay))

    @staticmethod
    def sides(g: torch.Tensor, max_precond_dim: int) -> list[int]:
        """The dimensions with a preconditioner: every one of a matrix (or higher) up to `max_precond_dim`; none of a
        vector or a scalar (plain Adam)."""
        return [i for i, size in enumerate(g.shape) if g.dim() >= 2 and size <= max_precond_dim]

    @staticmethod
    def accumulate(g: torch.Tensor, state: dict, beta: float) -> None:
        """GG_i ← β_s·GG_i + (1 − β_s)·(G contracted with itself over every dim but i): L = GG0, R = GG1."""
        for i in range(g.dim()):
            if f"GG{i}" in state:
                others = [d for d in range(g.dim()) if d != i]
                state[f"GG{i}"].lerp_(torch.tensordot(g, g, dims=(others, others)), 1 - beta)

    @staticmethod
    def refresh(state: dict, ndim: int) -> None:
        """One power-iteration step and a QR per side, Q ← qr(GG·Q), sorted by the estimated eigenvalues; V follows."""
        for i in range(ndim):
            if f"Q{i}" not in state:
                continue
            stat, q = state[f"GG{i}"], state[f"Q{i}"]
            power = stat @ q
            order = torch.argsort((q * power).sum(0), descending=True)  # qᵀ·GG·q: each column's eigenvalue estimate
            state["exp_avg_sq"] = state["exp_avg_sq"].index_select(i, order)
            work = torch.float32 if power.dtype in (torch.float16, torch.bfloat16) else power.dtype  # no bf16 QR
            state[f"Q{i}"] = torch.linalg.qr(power[:, order].to(work)).Q.to(power.dtype)

    def update(self, p: torch.Tensor, g: torch.Tensor, state: dict, group: dict) -> None:
        b1, b2 = group["betas"]
        decay = 1 - group["lr"] * group["weight_decay"]
        if not state:  # the first step measures only: statistics and their eigenbases
            state.update(step=0, exp_avg=torch.zeros_like(g), exp_avg_sq=torch.zeros_like(g))
            for i in self.sides(g, group["max_precond_dim"]):
                state[f"GG{i}"] = g.new_zeros(g.shape[i], g.shape[i])
            self.accumulate(g, state, group["shampoo_beta"])
            for i in self.sides(g, group["max_precond_dim"]):
                state[f"Q{i}"] = eigenbasis(state[f"GG{i}"])
            p.mul_(decay)
            return
        state["step"] += 1
        t = state["step"]
        bases = [state.get(f"Q{i}") for i in range(g.dim())]
        state["exp_avg"].lerp_(g, 1 - b1)
        state["exp_avg_sq"].lerp_(rotate(g, bases).square(), 1 - b2)
        direction = rotate(rotate(state["exp_avg"], bases) / (state["exp_avg_sq"].sqrt() + group["eps"]), bases,
                           back=True)
        p.add_(direction.to(p.dtype), alpha=-group["lr"] * math.sqrt(1 - b2 ** t) / (1 - b1 ** t))
        p.mul_(decay)
        self.accumulate(g, state, group["shampoo_beta"])
        if t % group["precondition_frequency"] == 0:
            self.refresh(state, g.dim())


def soap(groups: Iterable[dict], *, lr: PositiveFloat = 3e-3, betas: Betas = (0.95, 0.95), shampoo_beta: Beta = 0.95,
         eps: PositiveFloat = 1e-8, precondition_frequency: PositiveInt = 10, max_precond_dim: PositiveInt = 10000
         ) -> SOAP:
    """SOAP: Adam in the eigenbasis of Shampoo's L, R (EMA `shampoo_beta`), refreshed every `precondition_frequency`
    steps; sides longer than `max_precond_dim` unrotated (see `SOAP`)."""
    return SOAP(groups, lr=lr, betas=tuple(betas), shampoo_beta=shampoo_beta, eps=eps,
                precondition_frequency=precondition_frequency, max_precond_dim=max_precond_dim)


declare(soap, shards=("its statistics L = G·Gᵀ, R = Gᵀ·G and their eigendecompositions need each whole matrix, and "
                      "FSDP2 holds row shards of it; use trainer=ddp (every rank holds the whole matrices)"))
OPTION = soap
