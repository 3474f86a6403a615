"""Kimi Delta Attention (KDA; Kimi Team, 2025, "Kimi Linear: An Expressive, Efficient Attention Architecture"), as
transformers' KimiLinearDeltaAttention has it: Gated DeltaNet (gdn.py) with a fine-grained decay, one forget rate per
key channel of each head where GDN has one per head. With S_t (d_k × d_v) per head (HF's orientation),

    S_t = (I - β_t k_t k_tᵀ) Diag(α_t) S_{t-1} + β_t k_t v_tᵀ        o_t = S_tᵀ q_t

α_t = exp(g_t) ∈ (0, 1]^dk, g_t = -exp(A_log) · softplus(f_t + dt_bias) per channel (A_log one per head, dt_bias one
per channel), f_t = W_fb W_fa x_t a low-rank projection (rank `gate_rank`); β_t = σ(b_t) the write strength, one per
head; q and k L2-normalised per head (x / sqrt(Σx² + 1e-6), FLA's and HF's) and q scaled by 1/√d_k. GDN's scalar
decay commutes with (I - β k kᵀ), so its order does not matter; a diagonal one does not: KDA decays first and the
delta rule corrects the decayed state (it erases kᵀ Diag(α_t) S_{t-1}), as HF's and FLA's `state * exp(g)`, then the
read and the write.

Layout (HF's KimiLinearDeltaAttention; their names in `HF_NAMES`): in_proj_qkv d -> [q (H·dk), k (H·dk), v (H·dv)]
(HF: q_proj, k_proj, v_proj), a short causal conv + SiLU over [q, k, v] (no bias), b_proj d -> H, the forget gate
f_a_proj d -> r, f_b_proj r -> H·dk, dt_bias (H·dk), A_log (H), the output gate g_a_proj d -> r, g_b_proj r -> H·dv,
then the gated RMSNorm over dv per head, rmsnorm(o) · weight · sigmoid(gate) (sigmoid, where GDN's is silu(z)), and
out_proj H·dv -> d. Init as HF's (FLA's): A = U(1, 16), A_log = log A; dt log-uniform in [1e-3, 0.1] (floored at 1e-4),
dt_bias = softplus⁻¹(dt) (`dt_init=log_uniform`; `constant`: 1, GDN's Qwen3-Next init); the norm's gain 1.

Training runs the chunked form (`kimi_delta_rule`), GDN's WY/UT form with the decay a vector: within a chunk the
pseudo-values U solve (I + tril(β (k ⊙ d_ij)·k, -1)) U = βV - β (K ⊙ exp(γ)) S_0, d_ij = exp(γ_i - γ_j) per channel.
A per-channel decay does not factor into the (c × c) products (exp(γ_i)·exp(-γ_j) overflows), so the decays between
every pair of a chunk's tokens are held, a (c × c × dk) tensor per chunk and head, as HF's torch form holds them:
memory O(T · c · dk), hence the smaller default chunk (16; FLA's kernels tile by 16 inside their 64). The result does
not depend on the chunk. Generation continues the same form from `cache.state` ({"conv": (B, conv channels,
conv_size - 1), "ssm": (B, H, dk, dv)}). The recurrence runs in float32 (float64 for a float64 input) whatever the
autocast dtype. `backend`: auto or torch; lmlab has no kernel path for KDA (fla's chunk_kda is not wired), so auto is
the PyTorch form everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.mixer.backend import MixerBackend
from lmlab.model.mixer.base import (
    Chunks,
    MixerGeometry,
    Recurrent,
    ShortConv,
    across_chunks,
    log_uniform_dt_bias,
    recurrent_inputs,
)
from lmlab.model.mixer.gdn import l2norm
from lmlab.registry import PositiveFloat, PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import LayerCache


DT_RANGE = (1e-3, 0.1, 1e-4)  # dt_init=log_uniform: dt in [1e-3, 0.1], floored at 1e-4 (FLA's and HF's KDA init)
NO_KERNEL = "lmlab runs KDA in its PyTorch form only (fla's chunk_kda is not wired)"


class KimiDeltaAttention(Recurrent):
    """Keys: n_heads (H, null: model.n_head), head_dim (dk, null: model.d_model / n_heads), v_head_dim (dv, null:
    head_dim), gate_rank (the low-rank forget and output gates' inner size, null: v_head_dim, Kimi Linear's),
    conv_size, chunk_size (the training form's chunk), norm_eps (the gated norm's), dt_init (dt_bias's init:
    log_uniform, Kimi Linear's, or constant 1), backend (auto, torch). Under `attention.doc_mask` the state (and the
    conv window) resets at each document start."""

    # head=mlm refuses it: a recurrence over the past
    causal_only = "mixer=kda carries the past forward in its state: it has no bidirectional form"

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, pattern: list | None = None,
                 n_heads: PositiveInt | None = None, head_dim: PositiveInt | None = None,
                 v_head_dim: PositiveInt | None = None, gate_rank: PositiveInt | None = None,
                 conv_size: PositiveInt = 4, chunk_size: PositiveInt = 16, norm_eps: PositiveFloat = 1e-6,
                 dt_init: Literal["constant", "log_uniform"] = "log_uniform",
                 backend: Literal["auto", "torch"] = "auto") -> None:
        super().__init__()
        H, dk, dv, r = head_sizes(cfg, n_heads, head_dim, v_head_dim, gate_rank)
        self.n_heads, self.head_dim, self.v_head_dim = H, dk, dv
        self.backend = MixerBackend("kda", backend, "fla", NO_KERNEL)  # auto: torch everywhere (the refusal)
        self.chunk_size, self.norm_eps = chunk_size, norm_eps
        self.doc_reset = bool(cfg.attention.get("doc_mask"))
        kd, vd = H * dk, H * dv
        self.conv_dim = 2 * kd + vd
        self.in_proj_qkv = nn.Linear(cfg.d_model, self.conv_dim, bias=cfg.bias)
        self.in_proj_qkv.fused = (kd, kd, vd)  # q, k, v rows (read by the inits)
        self.in_proj_qkv.value_parts = (False, False, True)  # v carries the values (DeepNet's gain)
        self.b_proj = nn.Linear(cfg.d_model, H, bias=cfg.bias)  # the write strength's logit, per head
        self.conv = ShortConv(self.conv_dim, conv_size, bias=False)
        self.f_a_proj = nn.Linear(cfg.d_model, r, bias=False)  # the forget gate, low rank (dt_bias is its bias)
        self.f_b_proj = nn.Linear(r, kd, bias=False)
        self.A_log = nn.Parameter(torch.empty(H).uniform_(1, 16).log())  # HF's (FLA's) init: A ~ U(1, 16)
        self.dt_bias = nn.Parameter(torch.ones(kd) if dt_init == "constant" else log_uniform_dt_bias(kd, *DT_RANGE))
        self.g_a_proj = nn.Linear(cfg.d_model, r, bias=False)  # the output gate, low rank
        self.g_b_proj = nn.Linear(r, vd, bias=False)
        self.norm_weight = nn.Parameter(torch.ones(dv))  # the gated RMSNorm's gain (HF: o_norm.weight)
        self.out_proj = nn.Linear(vd, cfg.d_model, bias=cfg.bias)
        self.out_proj.is_residual_proj = True  # read by the init schemes (GPT-2's 1/sqrt(2L) scaling)
        self._figures: dict[str, torch.Tensor] = {}

    @classmethod
    def geometry(cls, cfg: GPTConfig, *, n_heads: int | None = None, head_dim: int | None = None,
                 v_head_dim: int | None = None, gate_rank: int | None = None, conv_size: int = 4,
                 chunk_size: int = 16, **_) -> MixerGeometry:
        """Weights: in_proj_qkv, b_proj, the conv, the two low-rank gates, A_log, dt_bias, the norm's gain, out_proj
        (exact). State: S per head and the conv's last k - 1 inputs. FLOPs per token of the chunked form, per head (c
        the chunk): the (c × c) products β (k ⊙ d)·k and q·(k ⊙ d) (2 · 2·c·dk, d the per-channel decays), the
        triangular solve for the pseudo-values and the decayed keys (c·(dk + dv)), the scores times U (2·c·dv), and
        three (dk × dv) products with the state (U's correction, the read-out, the update: 3 · 2·dk·dv); plus the
        conv (2·k per channel). Elementwise work (the decays between a chunk's tokens, norms, gates) left out."""
        H, dk, dv, r = head_sizes(cfg, n_heads, head_dim, v_head_dim, gate_rank)
        kd, vd, d = H * dk, H * dv, cfg.d_model
        conv_dim = 2 * kd + vd
        n = (d * (conv_dim + H) + conv_dim * conv_size + d * r + r * kd + kd + H + d * r + r * vd + dv + vd * d
             + cfg.bias * (conv_dim + H + d))
        c = chunk_size
        flops = H * (c * (5 * dk + 3 * dv) + 6 * dk * dv) + 2 * conv_size * conv_dim
        return MixerGeometry(n_params=n, state_numbers=H * dk * dv + (conv_size - 1) * conv_dim,
                             flops_per_token=flops)

    def forward(self, x: torch.Tensor, pos: object = None, cache: LayerCache | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:
        H, dk, dv = self.n_heads, self.head_dim, self.v_head_dim
        self.backend.choose(x)
        state, starts, dtype = recurrent_inputs(x, cache, doc, self.doc_reset)
        qkv, conv_state = self.conv(self.in_proj_qkv(x), state.get("conv"), starts)
        f, gate, b = self.f_b_proj(self.f_a_proj(x)), self.g_b_proj(self.g_a_proj(x)), self.b_proj(x)
        with torch.autocast(x.device.type, enabled=False):
            beta = torch.sigmoid(b.to(dtype))  # (B, T, H)
            A = torch.exp(self.A_log.to(dtype))[:, None]  # (H, 1): one rate per head, over its channels
            g = -A * F.softplus((f.to(dtype) + self.dt_bias.to(dtype)).unflatten(-1, (H, dk)))  # (B, T, H, dk)
            q, k, v = qkv.to(dtype).split((H * dk, H * dk, H * dv), dim=-1)
            q, k = (l2norm(t.unflatten(-1, (H, dk))).transpose(1, 2) for t in (q, k))  # (B, H, T, dk)
            o, S = kimi_delta_rule(q / math.sqrt(dk), k, v.unflatten(-1, (H, dv)).transpose(1, 2), g.transpose(1, 2),
                                   beta.transpose(1, 2), self.chunk_size, state.get("ssm"), starts)
            o = o.transpose(1, 2)  # (B, T, H, dv): the gated RMSNorm per head
            o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.norm_eps) * self.norm_weight.to(dtype)
            o = (o * torch.sigmoid(gate.to(dtype).unflatten(-1, (H, dv)))).flatten(2)
        state.update(conv=conv_state, ssm=S)
        self._figures = {"state_norm": S.detach().flatten(2).norm(dim=-1).mean(),
                         "gate_mean": torch.exp(g.detach()).mean(), "beta_mean": beta.detach().mean()}
        return self.out_proj(o.to(x.dtype))

    def figures(self) -> dict[str, torch.Tensor]:
        """The last forward's mean final-state norm ‖S‖_F (over sequences and heads), mean decay exp(g) (over tokens,
        heads and channels) and mean write strength β (over tokens and heads): detached scalars, no sync."""
        return dict(self._figures)


def kimi_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                    chunk: int, state: torch.Tensor | None = None, starts: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Kimi delta rule S_t = (I - β_t k_t k_tᵀ) Diag(exp(g_t)) S_{t-1} + β_t k_t v_tᵀ, o_t = S_tᵀ q_t, in chunks of
    `chunk`: q, k (b, h, T, dk) (q as read, scale included), v (b, h, T, dv), g (b, h, T, dk: per-channel log decays)
    and beta (b, h, T), from `state` (b, h, dk, dv) (zeros when None); `starts` (b, T): document starts, where the
    state is emptied. Returns o (b, h, T, dv) and the final state. T is padded to a multiple of the chunk with g = β =
    k = 0 (no decay, no write).

    Within a chunk, with γ_i = Σ_{m≤i} g_m (a vector) and d_ij = exp(γ_i - γ_j) for j ≤ i in i's document (else 0),
    the decayed state token i's delta step reads is Diag(exp(γ_i)) S_0 + Σ_{j<i} Diag(d_ij) k_j u_jᵀ; the
    pseudo-values u_j = β_j (v_j - (that state)ᵀ k_j) solve (I + tril(β_i (k_i ⊙ d_ij)·k_j, -1)) U = βV - β (K ⊙
    exp(γ)) S_0, so U = W_v - W_k S_0 (one triangular solve for both), o_i = S_0ᵀ (q_i ⊙ exp(γ_i)) + Σ_{j≤i} (q_i ⊙
    d_ij)·k_j u_j and the chunk's end keeps Diag(exp(γ_c)) S_0 + Σ_j (k_j ⊙ d_cj) u_jᵀ. A document start cuts d, the
    incoming state's reach and what the chunk's end keeps, as in gdn's gated_delta_rule."""
    b, h, T, dk = k.shape
    ch = Chunks.of(b, T, chunk, starts, q.device)
    n, c = ch.n, ch.c
    q, k, v, g, beta = (ch.split(t) for t in (q, k, v, g, beta))
    mask, carry, last = ch.mask, ch.carry, ch.last  # S_0 reaches i / j reaches the end
    # segsum[..., i, j, :] = Σ_{j<m≤i} g_m (0 for i <= j), per channel: summed directly, no difference of cumsums
    segsum = g[..., :, None, :].expand(b, h, n, c, c, dk).masked_fill(~ch.causal.tril(-1)[:, :, None], 0).cumsum(-3)
    decayed = torch.exp(segsum) * mask[..., None] * k[..., None, :, :]  # (b, h, n, c, c, dk): k_j ⊙ d_ij
    kb = k * beta[..., None]
    reach = torch.exp(g.cumsum(-2)) * carry[..., None]  # (b, h, n, c, dk): what of S_0 token i reads, exp(γ_i)
    system = (decayed @ kb[..., None])[..., 0]  # (b, h, n, c, c): β_i (k_i ⊙ d_ij)·k_j; the solve reads below the
    W = torch.linalg.solve_triangular(system, torch.cat((v * beta[..., None], kb * reach), -1),  # diagonal as ones
                                      upper=False, unitriangular=True)
    Wv, Wk = W.split((v.size(-1), dk), dim=-1)
    scores = (decayed @ q[..., None])[..., 0]  # (b, h, n, c, c): (q_i ⊙ d_ij)·k_j, the diagonal included
    qd = q * reach
    kd = k * torch.exp(segsum[..., -1, :, :]) * last[..., None]  # decayed to the chunk's end, last document only
    keep = torch.exp(g.sum(-2)) * carry[..., -1, None]  # (b, h, n, dk): what of S_0 the chunk's end keeps
    return across_chunks(Wv, Wk, qd, scores, kd, keep, state, T)


# our name -> HF's (KimiLinearDeltaAttention); in_proj_qkv is HF's q_proj, k_proj, v_proj stacked; the biases exist
# where model.bias (HF has none); A_log is (H,) here, (1, 1, H, 1) in HF
HF_NAMES = {"b_proj.weight": "b_proj.weight", "conv.conv.weight": "conv1d.weight",
            "f_a_proj.weight": "forget_gate.f_a_proj.weight", "f_b_proj.weight": "forget_gate.f_b_proj.weight",
            "A_log": "forget_gate.A_log", "dt_bias": "forget_gate.dt_bias", "g_a_proj.weight": "g_a_proj.weight",
            "g_b_proj.weight": "g_b_proj.weight", "norm_weight": "o_norm.weight", "out_proj.weight": "o_proj.weight"}
QKV = ("q_proj.weight", "k_proj.weight", "v_proj.weight")


def from_hf_state(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A HF KimiLinearDeltaAttention's weights (its state_dict, keys under `prefix`, e.g.
    "model.layers.0.self_attn.") as this module's state_dict (model.bias false: HF's layer has no biases)."""
    out = {ours: state[prefix + hf] for ours, hf in HF_NAMES.items()}
    out["A_log"] = out["A_log"].reshape(-1)
    out["in_proj_qkv.weight"] = torch.cat([state[prefix + name] for name in QKV])
    return out


def hf_state(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """This module's state_dict as a HF KimiLinearDeltaAttention's (keys under `prefix`): the inverse of
    `from_hf_state`."""
    out = {prefix + hf: state[ours] for ours, hf in HF_NAMES.items()}
    out[prefix + HF_NAMES["A_log"]] = state["A_log"].reshape(1, 1, -1, 1)
    H, dv = state["A_log"].numel(), state["norm_weight"].numel()
    kd = (state["in_proj_qkv.weight"].size(0) - H * dv) // 2
    out.update({prefix + name: t for name, t in zip(QKV, state["in_proj_qkv.weight"].split((kd, kd, H * dv)))})
    return out


def head_sizes(cfg: GPTConfig, n_heads: int | None, head_dim: int | None, v_head_dim: int | None,
               gate_rank: int | None) -> tuple[int, int, int, int]:
    """(heads, key head size, value head size, the gates' rank), checked: the heads divide model.d_model when head_dim
    is derived."""
    H = n_heads or cfg.n_head
    if head_dim is None and cfg.d_model % H:
        raise ValueError(f"mixer.n_heads={H} does not divide model.d_model={cfg.d_model}: set mixer.head_dim, or "
                         f"n_heads among {[n for n in range(1, cfg.d_model + 1) if cfg.d_model % n == 0]}")
    dk = head_dim or cfg.d_model // H
    dv = v_head_dim or dk
    return H, dk, dv, gate_rank or dv


OPTIONS = {"kda": KimiDeltaAttention}
