"""Linear attention (Katharopoulos et al., 2020, "Transformers are RNNs"): softmax(q·k) replaced by a feature map's
dot product φ(q)·φ(k), so causal attention becomes a recurrence over a fixed-size state:

    S_t = S_{t-1} + φ(k_t) v_tᵀ        (d × d_v per head)
    z_t = z_{t-1} + φ(k_t)             (d)
    o_t = φ(q_t)ᵀ S_t / (φ(q_t)ᵀ z_t + ε)

`feature`: φ = elu(x) + 1 (the paper's), relu, or identity (no map: the unnormalised "linear transformer" of the
later literature, with `normalize=false`). Training runs the chunked form (within a chunk the masked (c × c) product,
across chunks the state), generation the same code one token at a time from `cache.state`. The cheap baseline a
hybrid study needs: its state is all it remembers, with no forgetting gate.

`backend` (lmlab.model.mixer.backend): `fla` runs the numerator φ(q)ᵀ S_t on flash-linear-attention's
chunk_linear_attn (normalize off, scale 1: no 1/√d here), in its (B, T, h, d) layout with the same state S (B, h, d,
d_v), φ applied before it and φ(q), φ(k), v in the activations' dtype; the normaliser φ(q)·z_t + ε stays here, a
cumulative sum: fla's own normalize divides by φ(q)·z_t + 1e-10, not by `eps`, so it is not this formula. Document
starts are its varlen segments. It computes every config but odd head sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.mixer.backend import MixerBackend, kernel
from lmlab.model.mixer.base import MixerGeometry, Recurrent, recurrent_inputs, varlen
from lmlab.registry import PositiveFloat, PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import LayerCache

FEATURES = {"elu": lambda x: F.elu(x) + 1, "relu": F.relu, "identity": lambda x: x}


class LinearAttention(Recurrent):
    """Keys: n_heads (null: model.n_head), head_dim (null: model.d_model / n_heads), feature (φ), normalize, eps,
    chunk_size (the training form's chunk), backend (auto, torch, fla). Under `attention.doc_mask` the state resets at
    each document start."""

    # head=mlm refuses it: a recurrence over the past
    causal_only = "mixer=linear carries the past forward in its state: it has no bidirectional form"

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, pattern: list | None = None,
                 n_heads: PositiveInt | None = None, head_dim: PositiveInt | None = None,
                 feature: Literal["elu", "relu", "identity"] = "elu", normalize: bool = True,
                 eps: PositiveFloat = 1e-6, chunk_size: PositiveInt = 64,
                 backend: Literal["auto", "torch", "fla"] = "auto") -> None:
        super().__init__()
        self.n_heads, self.head_dim = _sizes(cfg, n_heads, head_dim)
        odd = f"its 16-bit backward takes even head sizes (mixer.head_dim={self.head_dim})"
        self.backend = MixerBackend("linear", backend, "fla", odd if self.head_dim % 2 else None)
        self.feature, self.normalize, self.eps, self.chunk_size = FEATURES[feature], normalize, eps, chunk_size
        self.doc_reset = bool(cfg.attention.get("doc_mask"))
        width = self.n_heads * self.head_dim
        self.c_attn = nn.Linear(cfg.d_model, 3 * width, bias=cfg.bias)
        self.c_attn.fused = (width, width, width)  # the q, k, v rows (read by the inits)
        self.c_attn.value_parts = (False, False, True)  # DeepNet's gain goes to v (lmlab.model.init)
        self.c_proj = nn.Linear(width, cfg.d_model, bias=cfg.bias)
        self.c_proj.is_residual_proj = True
        self._state_norm: torch.Tensor | None = None

    @classmethod
    def geometry(cls, cfg: GPTConfig, *, n_heads: int | None = None, head_dim: int | None = None,
                 chunk_size: int = 64, **_) -> MixerGeometry:
        """Weights: the q, k, v and output projections. State: S and z per head. FLOPs per token of the chunked form:
        the masked (c × c) products q·k and A·v (2·c·(d + d_v) per head, c the chunk), reading and adding to the
        state (2 · 2·d·d_v per head)."""
        h, d = _sizes(cfg, n_heads, head_dim)
        width = h * d
        n = cfg.d_model * 3 * width + width * cfg.d_model + cfg.bias * (3 * width + cfg.d_model)
        return MixerGeometry(n_params=n, state_numbers=h * (d * d + d),
                             flops_per_token=2 * h * (chunk_size * 2 * d + 2 * d * d))

    def forward(self, x: torch.Tensor, pos: object = None, cache: LayerCache | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        path = self.backend.choose(x)
        state, starts, dtype = recurrent_inputs(x, cache, doc, self.doc_reset)
        q, k, v = (t.view(B, T, self.n_heads, self.head_dim)
                   for t in self.c_attn(x).split(self.c_attn.fused, dim=-1))  # (B, T, h, d)
        if path == "fla":
            y, S, z = fla_linear_attention(q, k, v, self.feature, state.get("S"), state.get("z"), starts,
                                           self.normalize, self.eps, dtype)
        else:
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, h, T, d)
            q, k, v = self.feature(q.to(dtype)), self.feature(k.to(dtype)), v.to(dtype)
            S = state["S"] if state else q.new_zeros(B, self.n_heads, self.head_dim, self.head_dim)
            z = state["z"] if state else q.new_zeros(B, self.n_heads, self.head_dim)
            y, S, z = chunked(q, k, v, S, z, self.chunk_size, starts, self.normalize, self.eps)
            y = y.transpose(1, 2)  # (B, T, h, d)
        state.update(S=S, z=z)
        self._state_norm = S.detach().flatten(2).norm(dim=-1).mean()
        return self.c_proj(y.to(x.dtype).reshape(B, T, -1))

    def figures(self) -> dict[str, torch.Tensor]:
        """The last forward's mean final-state norm ‖S‖_F over sequences and heads."""
        return {} if self._state_norm is None else {"state_norm": self._state_norm}


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, S: torch.Tensor, z: torch.Tensor, chunk: int,
            starts: torch.Tensor | None, normalize: bool, eps: float
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal linear attention over φ-mapped q, k (B, h, T, d) and v (B, h, T, d_v) from the state (S, z), chunk by
    chunk; `starts` (B, T): document starts, where the state is emptied. Returns the outputs and the final state."""
    T, out = q.size(2), []
    for c0 in range(0, T, chunk):
        qc, kc, vc = q[:, :, c0:c0 + chunk], k[:, :, c0:c0 + chunk], v[:, :, c0:c0 + chunk]
        n = qc.size(2)
        mask = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()  # (n, n) query i reads key j <= i
        carry = torch.ones(q.size(0), 1, n, 1, dtype=q.dtype, device=q.device)  # whether S reaches token i
        last = None  # which keys of the chunk are in the chunk's last document (what the next state keeps)
        if starts is not None:
            seg = starts[:, c0:c0 + n].long().cumsum(1)  # (B, n): documents begun within the chunk so far
            mask = mask & (seg[:, :, None] == seg[:, None, :])[:, None]  # (B, 1, n, n)
            carry = (seg == 0)[:, None, :, None].to(q.dtype)
            last = (seg == seg[:, -1:])[:, None, :, None].to(q.dtype)  # (B, 1, n, 1)
        A = (qc @ kc.transpose(-1, -2)) * mask  # (B, h, n, n)
        y = A @ vc + carry * (qc @ S)
        if normalize:
            y = y / (A.sum(-1, keepdim=True) + carry * (qc @ z[..., None]) + eps)
        out.append(y)
        kept = kc if last is None else kc * last
        if starts is not None:  # a document began in the chunk: the state before it is gone
            keep_old = carry[:, :, -1:, :]  # (B, 1, 1, 1)
            S, z = keep_old * S, keep_old[..., 0] * z
        S = S + kept.transpose(-1, -2) @ vc
        z = z + kept.sum(2)
    return torch.cat(out, dim=2), S, z


def fla_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, feature: Callable, S: torch.Tensor | None,
                         z: torch.Tensor | None, starts: torch.Tensor | None, normalize: bool, eps: float,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunked` with its numerator on fla's kernel, in its layout: q, k, v (B, T, h, d) before φ, from the state S (B,
    h, d, d_v) and z (B, h, d) (zeros when None); `starts` (B, T): document starts (fla's varlen segments). Returns the
    outputs (B, T, h, d_v) and the final S, z, in `dtype`."""
    B, T = q.shape[:2]
    fq, fk = feature(q.to(dtype)), feature(k.to(dtype))
    inputs, keys = (fq.to(v.dtype), fk.to(v.dtype), v), dict(scale=1.0, output_final_state=True, normalize=False)
    attend = kernel("fla.ops.linear_attn", "chunk_linear_attn")
    if starts is None:
        y, S = attend(*inputs, initial_state=S, **keys)
    else:
        cu_seqlens, initial, last = varlen(starts, S)
        y, S = attend(*(t.flatten(0, 1)[None] for t in inputs), initial_state=initial, cu_seqlens=cu_seqlens, **keys)
        y, S = y.view(B, T, *y.shape[2:]), S[last]
    sums = _key_sums(fk, z, starts)  # (B, T, h, d): z_t of each token
    y = y.to(dtype)
    if normalize:
        y = y / ((fq * sums).sum(-1, keepdim=True) + eps)
    return y, S.to(dtype), sums[:, -1]


def _key_sums(k: torch.Tensor, z: torch.Tensor | None, starts: torch.Tensor | None) -> torch.Tensor:
    """z_t (B, T, h, d) for φ-mapped keys k (B, T, h, d): the keys summed over t's document up to t, plus the state's
    z (B, h, d) for the tokens before any document start among these."""
    sums = k.cumsum(1)
    if starts is not None:
        idx = torch.arange(k.size(1), device=k.device)
        latest = torch.where(starts, idx, 0).cummax(1).values  # (B, T): t's latest document start (0: none)
        sums = sums - (sums - k).gather(1, latest[:, :, None, None].expand_as(k))  # less the sums before it
    if z is None:
        return sums
    fresh = 1.0 if starts is None else (starts.cumsum(1) == 0)[:, :, None, None].to(k.dtype)  # no start yet
    return sums + fresh * z[:, None]


def _sizes(cfg: GPTConfig, n_heads: int | None, head_dim: int | None) -> tuple[int, int]:
    h = n_heads or cfg.n_head
    if head_dim is None and cfg.d_model % h:
        raise ValueError(f"mixer.n_heads={h} does not divide model.d_model={cfg.d_model}: set mixer.head_dim, or "
                         f"n_heads among {[n for n in range(1, cfg.d_model + 1) if cfg.d_model % n == 0]}")
    return h, head_dim or cfg.d_model // h


OPTIONS = {"linear": LinearAttention}
