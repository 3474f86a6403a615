"""Gated DeltaNet (Yang, Kautz & Hatamizadeh, ICLR 2025, "Gated Delta Networks: Improving Mamba2 with Delta Rule"),
as Qwen3-Next has it: a fast-weight memory per value head that decays (Mamba-2's gate) and is corrected toward each
new key's value (the delta rule). With S_t (d_k × d_v) per head (HF's orientation: the paper's S is its transpose),

    S_t = exp(g_t) (I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ        o_t = S_tᵀ q_t

g_t = -exp(A_log) · softplus(a_t + dt_bias) ≤ 0 the log decay, β_t = σ(b_t) the write strength, q and k
L2-normalised per head (x · rsqrt(Σx² + 1e-6), FLA's and HF's form) and q scaled by 1/√d_k.

Layout (HF's Qwen3NextGatedDeltaNet): in_proj_qkvz d -> [q (Hk·dk), k (Hk·dk), v (Hv·dv), z (Hv·dv)], in_proj_ba
d -> [b (Hv), a (Hv)], a short causal conv + SiLU over [q, k, v] (no bias), A_log and dt_bias (Hv), each key head
repeated to the Hv / Hk value heads after it (value head i reads key head i // (Hv / Hk)), then the gated RMSNorm
over dv per head, rmsnorm(o) · weight · silu(z), and out_proj Hv·dv -> d. Our fused rows are blocked by part (q of
every head, then k, ...), so the inits can read them as parts (`fused`); HF's are grouped per key head ([q_h, k_h,
v_h, z_h] for each key head h, and [b_h, a_h] likewise): `from_hf_state` / `hf_state` reorder them, a reshape (the
conv's channels, [q, k, v] by part, are the same in both). Init as HF's: A = U(0.01, 16), A_log = log A, the norm's
gain 1, and `dt_init`: `constant`, Qwen3-Next's dt_bias = 1 (a step softplus(1) ≈ 1.3, so a head keeps exp(-1.3·A)
of its state per token at the start: e^-10 for A = 8, the state nearly wiped every token), or `log_uniform`, the GDN
paper's code (Mamba's): dt log-uniform in [1e-3, 0.1] (floored at 1e-4), dt_bias = softplus⁻¹(dt): slow decays.

Training runs the chunked form (`gated_delta_rule`): within a chunk the delta rule's pseudo-values U solve the
unit-lower-triangular system (I + tril(β k kᵀ ⊙ decay, -1)) U = βV - β exp(γ) K S_0 (the WY/UT representation,
DeltaNet's), then the chunk's outputs and its state are matmuls and the state is passed to the next chunk; the result
does not depend on the chunk. Generation continues the same form from `cache.state` ({"conv": (B, conv channels,
conv_size - 1), "ssm": (B, Hv, dk, dv)}). The recurrence runs in float32 (float64 for a float64 input) whatever the
autocast dtype.

`backend` (lmlab.model.mixer.backend): `fla` runs the recurrence on flash-linear-attention's chunk_gated_delta_rule
(fused_recurrent_gated_delta_rule for one-token steps without autograd), in its (B, T, heads, d) layout with the same
state (B, Hv, dk, dv): q, k, v in the activations' dtype (bf16 under autocast), g, β and the state in float32; the L2
norm (same epsilon) and 1/√dk inside the kernel, the key heads read by value head i // (Hv / Hk) as here; document
starts as its varlen segments. It computes every config but head sizes over 256 or odd ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.mixer.backend import MixerBackend, kernel
from lmlab.model.mixer.base import (
    Chunks,
    MixerGeometry,
    Recurrent,
    ShortConv,
    across_chunks,
    log_uniform_dt_bias,
    recurrent_inputs,
    varlen,
)
from lmlab.registry import PositiveFloat, PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import LayerCache


DT_RANGE = (1e-3, 0.1, 1e-4)  # dt_init=log_uniform: dt in [1e-3, 0.1], floored at 1e-4 (the GDN paper's code)


class GatedDeltaNet(Recurrent):
    """Keys: n_heads (key heads Hk, null: model.n_head), n_v_heads (value heads Hv, a multiple of n_heads; null:
    n_heads; Qwen3-Next: 16 and 32), head_dim (dk, null: model.d_model / n_heads), v_head_dim (dv, null: head_dim),
    conv_size, chunk_size (the training form's chunk), norm_eps (the gated norm's), dt_init (dt_bias's init: constant
    1 or log_uniform), backend (auto, torch, fla). Under `attention.doc_mask` the state (and the conv window) resets
    at each document start."""

    # head=mlm refuses it: a recurrence over the past
    causal_only = "mixer=gdn carries the past forward in its state: it has no bidirectional form"

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, pattern: list | None = None,
                 n_heads: PositiveInt | None = None, n_v_heads: PositiveInt | None = None,
                 head_dim: PositiveInt | None = None, v_head_dim: PositiveInt | None = None,
                 conv_size: PositiveInt = 4, chunk_size: PositiveInt = 64, norm_eps: PositiveFloat = 1e-6,
                 dt_init: Literal["constant", "log_uniform"] = "constant",
                 backend: Literal["auto", "torch", "fla"] = "auto") -> None:
        super().__init__()
        self.n_heads, self.n_v_heads, self.head_dim, self.v_head_dim = head_sizes(cfg, n_heads, n_v_heads, head_dim,
                                                                               v_head_dim)
        self.backend = MixerBackend("gdn", backend, "fla", fla_refuses(self.head_dim, self.v_head_dim))
        self.chunk_size, self.norm_eps = chunk_size, norm_eps
        self.doc_reset = bool(cfg.attention.get("doc_mask"))
        kd, vd, Hv = self.n_heads * self.head_dim, self.n_v_heads * self.v_head_dim, self.n_v_heads
        self.conv_dim = 2 * kd + vd
        self.in_proj_qkvz = nn.Linear(cfg.d_model, 2 * kd + 2 * vd, bias=cfg.bias)
        self.in_proj_qkvz.fused = (kd, kd, vd, vd)  # q, k, v, z rows (read by the inits)
        self.in_proj_qkvz.value_parts = (False, False, True, False)  # v carries the values (DeepNet's gain)
        self.in_proj_ba = nn.Linear(cfg.d_model, 2 * Hv, bias=cfg.bias)
        self.in_proj_ba.fused = (Hv, Hv)  # b (the write strength's logit), a (the decay's step)
        self.conv = ShortConv(self.conv_dim, conv_size, bias=False)
        self.A_log = nn.Parameter(torch.empty(Hv).uniform_(0.01, 16).log())  # HF's init: A ~ U(0.01, 16)
        self.dt_bias = nn.Parameter(torch.ones(Hv) if dt_init == "constant" else log_uniform_dt_bias(Hv, *DT_RANGE))
        self.norm_weight = nn.Parameter(torch.ones(self.v_head_dim))  # the gated RMSNorm's gain (HF: norm.weight)
        self.out_proj = nn.Linear(vd, cfg.d_model, bias=cfg.bias)
        self.out_proj.is_residual_proj = True  # read by the init schemes (GPT-2's 1/sqrt(2L) scaling)
        self._figures: dict[str, torch.Tensor] = {}

    @classmethod
    def geometry(cls, cfg: GPTConfig, *, n_heads: int | None = None, n_v_heads: int | None = None,
                 head_dim: int | None = None, v_head_dim: int | None = None, conv_size: int = 4,
                 chunk_size: int = 64, **_) -> MixerGeometry:
        """Weights: in_proj_qkvz, in_proj_ba, the conv, A_log, dt_bias, the norm's gain, out_proj (exact). State: S
        per value head and the conv's last k - 1 inputs. FLOPs per token of the chunked form, per value head (c the
        chunk): the (c × c) products β k·kᵀ and q·kᵀ (2 · 2·c·dk), the triangular solve for the pseudo-values and
        the decayed keys (c·(dk + dv)), the scores times U (2·c·dv), and three (dk × dv) products with the state
        (U's correction, the read-out, the update: 3 · 2·dk·dv); plus the conv (2·k per channel). Elementwise work
        (norms, gates, decays) left out."""
        Hk, Hv, dk, dv = head_sizes(cfg, n_heads, n_v_heads, head_dim, v_head_dim)
        kd, vd = Hk * dk, Hv * dv
        conv_dim, proj = 2 * kd + vd, 2 * kd + 2 * vd + 2 * Hv
        n = (cfg.d_model * proj + conv_dim * conv_size + 2 * Hv + dv + vd * cfg.d_model
             + cfg.bias * (proj + cfg.d_model))
        c = chunk_size
        flops = Hv * (c * (5 * dk + 3 * dv) + 6 * dk * dv) + 2 * conv_size * conv_dim
        return MixerGeometry(n_params=n, state_numbers=Hv * dk * dv + (conv_size - 1) * conv_dim,
                             flops_per_token=flops)

    def forward(self, x: torch.Tensor, pos: object = None, cache: LayerCache | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        Hk, Hv, dk, dv = self.n_heads, self.n_v_heads, self.head_dim, self.v_head_dim
        path = self.backend.choose(x)
        state, starts, dtype = recurrent_inputs(x, cache, doc, self.doc_reset)
        qkv, z = self.in_proj_qkvz(x).split((self.conv_dim, Hv * dv), dim=-1)
        b, a = self.in_proj_ba(x).chunk(2, dim=-1)
        qkv, conv_state = self.conv(qkv, state.get("conv"), starts)
        with torch.autocast(x.device.type, enabled=False):
            beta = torch.sigmoid(b.to(dtype))  # (B, T, Hv)
            g = -torch.exp(self.A_log.to(dtype)) * F.softplus(a.to(dtype) + self.dt_bias.to(dtype))  # (B, T, Hv)
            q, k, v = qkv.split((Hk * dk, Hk * dk, Hv * dv), dim=-1)
            q, k, v = q.unflatten(-1, (Hk, dk)), k.unflatten(-1, (Hk, dk)), v.unflatten(-1, (Hv, dv))  # (B, T, H, d)
            if path == "fla":
                o, S = fla_gated_delta_rule(q, k, v, g, beta, 1 / math.sqrt(dk), state.get("ssm"), starts)
            else:
                q, k = (l2norm(t.to(dtype)).repeat_interleave(Hv // Hk, dim=2).transpose(1, 2)
                        for t in (q, k))  # (B, Hv, T, dk): value head i reads key head i // (Hv / Hk)
                o, S = gated_delta_rule(q / math.sqrt(dk), k, v.to(dtype).transpose(1, 2), g.transpose(1, 2),
                                        beta.transpose(1, 2), self.chunk_size, state.get("ssm"), starts)
                o = o.transpose(1, 2)
            o, S = o.to(dtype), S.to(dtype)  # o (B, T, Hv, dv): the gated RMSNorm per head
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight.to(dtype)
            o = (o * F.silu(z.to(dtype).unflatten(-1, (Hv, dv)))).flatten(2)
        state.update(conv=conv_state, ssm=S)
        self._figures = {"state_norm": S.detach().flatten(2).norm(dim=-1).mean(),
                         "gate_mean": torch.exp(g.detach()).mean(), "beta_mean": beta.detach().mean()}
        return self.out_proj(o.to(x.dtype))

    def figures(self) -> dict[str, torch.Tensor]:
        """The last forward's mean final-state norm ‖S‖_F (over sequences and value heads), mean decay exp(g) and
        mean write strength β (over tokens and heads): detached scalars, no sync."""
        return dict(self._figures)


def fla_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         scale: float, state: torch.Tensor | None, starts: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule on fla's kernels, in their layout: q, k (B, T, Hk, dk) before the L2 norm (the kernel's,
    x · rsqrt(Σx² + 1e-6) as `l2norm`), v (B, T, Hv, dv), g (log decays) and beta (B, T, Hv), from `state` (B, Hv, dk,
    dv) or zeros; `starts` (B, T): document starts, where the state is emptied (fla's varlen segments). Returns o (B,
    T, Hv, dv) and the final state."""
    ops = "fla.ops.gated_delta_rule"
    keys = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if q.size(1) == 1 and not torch.is_grad_enabled():  # a generation step: the recurrent kernel, no chunk to fill
        if starts is not None and state is not None:
            state = state * (~starts).to(state.dtype)[:, :, None, None]
        return kernel(ops, "fused_recurrent_gated_delta_rule")(q=q, k=k, v=v, g=g, beta=beta, initial_state=state,
                                                               **keys)
    chunk = kernel(ops, "chunk_gated_delta_rule")
    if starts is None:
        return chunk(q, k, v, g, beta, initial_state=state, **keys)
    B, T = starts.shape
    cu_seqlens, initial, last = varlen(starts, state)
    o, S = chunk(*(t.flatten(0, 1)[None] for t in (q, k, v, g, beta)), initial_state=initial, cu_seqlens=cu_seqlens,
                 **keys)  # one row of the B·T tokens, cut into segments
    return o.view(B, T, *o.shape[2:]), S[last]


def fla_refuses(head_dim: int, v_head_dim: int) -> str | None:
    """Why fla's gated delta rule cannot compute these head sizes (None: it can)."""
    if head_dim > 256:
        return f"its kernels take key heads of at most 256 (mixer.head_dim={head_dim})"
    if head_dim % 2 or v_head_dim % 2:
        return f"its 16-bit backward takes even head sizes (mixer.head_dim={head_dim}, v_head_dim={v_head_dim})"
    return None


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dimension (FLA's and HF's form of the L2 normalisation)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     chunk: int, state: torch.Tensor | None = None, starts: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule S_t = exp(g_t)(I - β_t k_t k_tᵀ) S_{t-1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t, in chunks of
    `chunk`: q, k (b, h, T, dk) (q as read, scale included), v (b, h, T, dv), g (log decays) and beta (b, h, T), from
    `state` (b, h, dk, dv) (zeros when None); `starts` (b, T): document starts, where the state is emptied. Returns o
    (b, h, T, dv) and the final state. T is padded to a multiple of the chunk with g = β = k = 0 (no decay, no write).

    Within a chunk, with γ_i = Σ_{m≤i} g_m and D_ij = exp(γ_i - γ_j) for j ≤ i in i's document (else 0), the state
    before token i is exp(γ_i) S_0 + Σ_{j<i} D_ij k_j u_jᵀ; the pseudo-values u_j = β_j (v_j - (that state)ᵀ k_j)
    solve (I + tril(β k kᵀ ⊙ D, -1)) U = βV - β exp(γ) K S_0, so U = W_v - W_k S_0 (one triangular solve for both),
    o_i = exp(γ_i) S_0ᵀ q_i + Σ_{j≤i} D_ij (q_i·k_j) u_j and the chunk's end keeps exp(γ_c) S_0 + Σ_j D_cj k_j u_jᵀ.
    A document start cuts D, the incoming state's reach (tokens after a start in the chunk read none of it) and what
    the chunk's end keeps (the last document's keys only)."""
    b, h, T, dk = k.shape
    ch = Chunks.of(b, T, chunk, starts, q.device)
    q, k, v, g, beta = (ch.split(t) for t in (q, k, v, g, beta))
    mask, carry, last = ch.mask, ch.carry, ch.last  # S_0 reaches i / j reaches the end
    # segsum[i, j] = Σ_{j<m≤i} g_m (0 for i <= j): summed directly, no difference of cumsums and no -inf
    segsum = g[..., :, None].expand(*g.shape, ch.c).masked_fill(~ch.causal.tril(-1), 0).cumsum(-2)
    D = torch.exp(segsum) * mask  # (b, h, n, c, c): decay from j to i, zero across documents and above the diagonal
    kb = k * beta[..., None]
    reach = torch.exp(g.cumsum(-1)) * carry  # (b, h, n, c): what of S_0 token i reads, exp(γ_i)
    system = (kb @ k.transpose(-1, -2)) * D  # its strict lower triangle; the solve takes the diagonal as ones
    W = torch.linalg.solve_triangular(system, torch.cat((v * beta[..., None], kb * reach[..., None]), -1),
                                      upper=False, unitriangular=True)
    Wv, Wk = W.split((v.size(-1), dk), dim=-1)
    scores = (q @ k.transpose(-1, -2)) * D  # (b, h, n, c, c), the diagonal included
    qd = q * reach[..., None]
    kd = k * (torch.exp(segsum[..., -1, :]) * last)[..., None]  # decayed to the chunk's end, last document only
    keep = torch.exp(g.sum(-1)) * carry[..., -1]  # (b, h, n): what of S_0 the chunk's end keeps
    return across_chunks(Wv, Wk, qd, scores, kd, keep[..., None], state, T)


def _regroup(t: torch.Tensor, n_heads: int, parts: tuple[int, ...], to_hf: bool) -> torch.Tensor:
    """A fused projection's rows (and bias) between our order, by part ([p1 of every key head, p2 of every ...]), and
    HF's, by key head ([p1, p2, ... of head 0, then of head 1, ...]); `parts`: each part's rows per key head."""
    rest = t.shape[1:]
    if to_hf:
        blocks = [p.reshape(n_heads, size, *rest) for p, size in zip(t.split([n_heads * s for s in parts]), parts)]
        return torch.cat(blocks, dim=1).reshape(-1, *rest)
    blocks = t.reshape(n_heads, sum(parts), *rest).split(parts, dim=1)
    return torch.cat([p.reshape(-1, *rest) for p in blocks])


# our name -> HF's (Qwen3NextGatedDeltaNet); the biases exist where model.bias (HF has none)
HF_NAMES = {"in_proj_qkvz.weight": "in_proj_qkvz.weight", "in_proj_qkvz.bias": "in_proj_qkvz.bias",
            "in_proj_ba.weight": "in_proj_ba.weight", "in_proj_ba.bias": "in_proj_ba.bias",
            "conv.conv.weight": "conv1d.weight", "A_log": "A_log", "dt_bias": "dt_bias", "norm_weight": "norm.weight",
            "out_proj.weight": "out_proj.weight", "out_proj.bias": "out_proj.bias"}


def _convert(state: Mapping[str, torch.Tensor], prefix: str, n_heads: int, to_hf: bool) -> dict[str, torch.Tensor]:
    """Rename (ours <-> HF's under `prefix`), and regroup the fused projections' rows; sizes from the tensors (Hv:
    A_log's, dv: the norm's gain's, dk: the qkvz rows left over) and the key heads `n_heads`."""
    pairs = [(ours, prefix + hf) if to_hf else (prefix + hf, ours) for ours, hf in HF_NAMES.items()]
    get = {ours: state[src] for (src, _), ours in zip(pairs, HF_NAMES) if src in state}  # by our name
    Hv, dv = get["A_log"].numel(), get["norm_weight"].numel()
    dk = (get["in_proj_qkvz.weight"].size(0) - 2 * Hv * dv) // (2 * n_heads)
    parts = {"in_proj_qkvz": (dk, dk, Hv // n_heads * dv, Hv // n_heads * dv), "in_proj_ba": (Hv // n_heads,) * 2}
    out = {}
    for (src, dst), ours in zip(pairs, HF_NAMES):
        if ours in get:
            part = parts.get(ours.split(".")[0])
            out[dst] = get[ours] if part is None else _regroup(get[ours], n_heads, part, to_hf)
    return out


def from_hf_state(state: Mapping[str, torch.Tensor], prefix: str = "", *, n_heads: int) -> dict[str, torch.Tensor]:
    """A HF Qwen3NextGatedDeltaNet's weights (its state_dict, keys under `prefix`, e.g. "model.layers.0.linear_attn.")
    as this module's state_dict; `n_heads`: the key heads (HF: linear_num_key_heads)."""
    return _convert(state, prefix, n_heads, to_hf=False)


def hf_state(state: Mapping[str, torch.Tensor], prefix: str = "", *, n_heads: int) -> dict[str, torch.Tensor]:
    """This module's state_dict as a HF Qwen3NextGatedDeltaNet's (keys under `prefix`): the inverse of
    `from_hf_state`."""
    return _convert(state, prefix, n_heads, to_hf=True)


def head_sizes(cfg: GPTConfig, n_heads: int | None, n_v_heads: int | None, head_dim: int | None,
               v_head_dim: int | None) -> tuple[int, int, int, int]:
    """(key heads, value heads, key head size, value head size), checked: the key heads divide model.d_model when
    head_dim is derived, the value heads are a multiple of the key heads."""
    Hk = n_heads or cfg.n_head
    if head_dim is None and cfg.d_model % Hk:
        raise ValueError(f"mixer.n_heads={Hk} does not divide model.d_model={cfg.d_model}: set mixer.head_dim, or "
                         f"n_heads among {[n for n in range(1, cfg.d_model + 1) if cfg.d_model % n == 0]}")
    Hv = n_v_heads or Hk
    if Hv % Hk:
        raise ValueError(f"mixer.n_v_heads={Hv} is not a multiple of mixer.n_heads={Hk} (the key heads, each read by "
                         f"n_v_heads / n_heads value heads): use one of {[Hk * r for r in range(1, 5)]}, ...")
    dk = head_dim or cfg.d_model // Hk
    return Hk, Hv, dk, v_head_dim or dk


OPTIONS = {"gdn": GatedDeltaNet}
