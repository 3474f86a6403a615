"""`residual=hyper`: hyper-connections (Zhu et al., 2024, "Hyper-Connections"): the stream widens to n copies H (n × d
per token), and each sublayer k (attention and FFN counted apart) reads a mix of them and writes its branch back into
each with its own weight, the streams also mixing among themselves:

    h_k = Σ_i A_m[i]·H_i,   y_k = branch_k(h_k),   H'_j = Σ_i A_r[i, j]·H_i + B[j]·y_k

(the paper's Ĥ = Bᵀ·T(Hᵀ A_m) + A_rᵀ H). Static weights start as the pre-norm stream spread over the copies: sublayer
k reads copy k mod n (A_m = e_(k mod n)), A_r = I, B = 1; with `dynamic` (DHC) each token adds tanh(RMSNorm(H)·W)·s to
A_m, A_r (W: d × (n + 1), zero at init) and to B (W: d), the scales s learned from 0.01. The model's embedding output
fills every copy; the copies are summed before the final norm. With n = 1 and the static weights it is the standard
stream exactly (tested). The monitor's per-layer stream figures (`act/rms`) read the n copies together.
Needs a placement that adds each branch (pre, double, post_nonres) and stands alone among the residual options.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.registry import PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.placement import Block, Sublayer


class HyperConnection(nn.Module):
    """One sublayer's connection: static α (n × (n + 1): column 0 = A_m, the rest A_r) and β (n), dynamic parts."""

    def __init__(self, d_model: int, n: int, k: int, dynamic: bool) -> None:
        super().__init__()
        alpha = torch.zeros(n, n + 1)
        alpha[k % n, 0] = 1.0
        alpha[:, 1:] = torch.eye(n)
        self.alpha = nn.Parameter(alpha)
        self.beta = nn.Parameter(torch.ones(n))
        self.dynamic = dynamic
        if dynamic:
            self.w_alpha = nn.Parameter(torch.zeros(d_model, n + 1))
            self.w_beta = nn.Parameter(torch.zeros(d_model))
            self.s_alpha = nn.Parameter(torch.full((), 0.01))
            self.s_beta = nn.Parameter(torch.full((), 0.01))

    def weights(self, H: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """α (…, n, n + 1) and β (…, n) for the streams H (B, T, n, d): static, plus the tokens' dynamic parts."""
        alpha, beta = self.alpha.to(H.dtype), self.beta.to(H.dtype)
        if not self.dynamic:
            return alpha, beta
        normed = F.rms_norm(H, (H.size(-1),))
        alpha = alpha + self.s_alpha * torch.tanh(normed @ self.w_alpha.to(H.dtype))  # (B, T, n, n + 1)
        beta = beta + self.s_beta * torch.tanh(normed @ self.w_beta.to(H.dtype))  # (B, T, n)
        return alpha, beta

    def forward(self, H: torch.Tensor, branch) -> torch.Tensor:
        alpha, beta = self.weights(H)
        h = torch.einsum("...i,...id->...d", alpha[..., 0], H)  # the sublayer's input: a mix of the copies
        y = branch(h)  # (B, T, d)
        mixed = torch.einsum("...ij,...id->...jd", alpha[..., 1:], H)  # H'_j = Σ_i A_r[i, j] H_i
        return mixed + beta[..., None] * y[..., None, :]


class HyperWiring(nn.ModuleList):
    """The wiring: the block's sublayers in turn over the n copies, each through its own connection."""

    def wire(self, block: Block, x: torch.Tensor, fs: list[tuple[int, Sublayer]]) -> torch.Tensor:
        for j, f in fs:  # x: the n copies of the stream (B, T, n, d)
            x = self[j - 1](x, partial(self._branch, block, f, j))
        return x

    @staticmethod
    def _branch(block: Block, f: Sublayer, j: int, h: torch.Tensor) -> torch.Tensor:
        return block.transform(j, block.branch(h, f, j))


class Hyper(nn.Module):
    def __init__(self, cfg: GPTConfig, *, streams: PositiveInt = 4, dynamic: bool = True) -> None:
        super().__init__()
        if others := sorted(set(cfg.residual) - {"hyper", "standard"}):
            raise ValueError(f"residual=hyper widens the stream to n copies: it does not stack with residual="
                             f"{others[0]} (choose one or the other)")
        self.n, self.dynamic, self.d_model, self.n_layer = streams, dynamic, cfg.d_model, cfg.n_layer

    def attach(self, model: nn.Module) -> None:
        k = 0
        for block in model.h:
            if not block.additive:
                raise ValueError(f"residual=hyper adds each sublayer's branch to the copies: placement="
                                 f"{model.cfg.placement['name']!r} normalises the sum; use placement=pre|double|"
                                 f"post_nonres")
            connections = []
            for _ in block.sublayer_names:
                connections.append(HyperConnection(self.d_model, self.n, k, self.dynamic))
                k += 1
            block.set_wiring("hyper", HyperWiring(connections), "hyper")

    def before(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x.unsqueeze(-2).expand(*x.shape[:-1], self.n, x.size(-1)) if i == 0 else x  # every copy: x0

    def after(self, i: int, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-2) if i == self.n_layer - 1 else x  # (B, T, d) for the final norm


OPTIONS = {"hyper": Hyper}
