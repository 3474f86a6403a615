"""Mamba-2 (Dao & Gu, 2024, "Transformers are SSMs": structured state space duality, SSD): a selective state space
layer with a scalar decay per head, the recurrent mixer of the hybrid stacks (Nemotron-H, Bamba, Falcon-H1).

Per head (A < 0 a learned scalar, dt_t > 0 the token's step, B_t, C_t ∈ R^N shared by the heads of a group):

    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_tᵀ          (head_dim × N)
    y_t = h_t C_t + D x_t

Layout (HF's Mamba2Mixer / NemotronHMamba2Mixer, so weights map one to one: `from_hf_state`, `hf_state`): in_proj
d -> [z (d_inner), xBC (d_inner + 2·G·N), dt (H)]; a short causal conv + SiLU over xBC; dt = softplus(dt + dt_bias)
clamped to `dt_limit`; the scan; then the gated RMSNorm, per group of d_inner / G channels, of y ⊙ silu(z) (HF's
MambaRMSNormGated, norm_before_gate=false: Mamba-2, Nemotron-H, Bamba; `norm_before_gate=true`: norm(y) ⊙ silu(z),
Falcon-H1's option); out_proj d_inner -> d. Nemotron-H clamps dt from below at its dt_min (`dt_limit=[0.001, null]`)
and inits dt_bias to ones; here dt_bias follows Mamba2Mixer's init (softplus⁻¹ of a log-uniform dt in [dt_min,
dt_max]), A_log = log(1..H), D = 1.

Training runs the chunked SSD form (`ssd`): within a chunk of c tokens the masked (c × c) "attention" C_i·B_j times
the decay exp(Σ_{j<k≤i} dt_k A), across chunks the state passed on; the result does not depend on c. Generation
continues the same form from `cache.state` ({"conv": (B, conv channels, k - 1), "ssm": (B, H, head_dim, N)}). The
scan runs in float32 (float64 for a float64 input) whatever the autocast dtype.

`backend` (lmlab.model.mixer.backend): `mamba_ssm` runs the scan on mamba-ssm's mamba_chunk_scan_combined (the
reference SSD kernel; `auto` takes it on CUDA where mamba_ssm imports), in the same layout: x (B, T, H, head_dim), B
and C (B, T, G, N) per group, the state (B, H, head_dim, N); x, B, C in the activations' dtype, dt (softplus and
clamp done here), A, D and the state in float32; D's skip inside the kernel, the gated norm here; document starts as
its `seq_idx` (each token's document number among these tokens, 0 before the first start: the tokens that read the
carried state). It computes every config. (fla has no Mamba-2 op of that name; its simple_gla computes the same scan
with C, B, x·dt, dt·A as q, k, v, g: a possible second kernel.)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.mixer.backend import MixerBackend, kernel
from lmlab.model.mixer.base import MixerGeometry, Recurrent, ShortConv, log_uniform_dt_bias, recurrent_inputs
from lmlab.registry import PositiveFloat, PositiveInt, Range

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import LayerCache


class Mamba2(Recurrent):
    """Keys: d_state (N), expand (d_inner = expand·d_model), head_dim (H = d_inner / head_dim heads), n_groups (G
    groups of heads sharing B and C), conv_size, chunk_size (the training form's chunk), norm_eps (the gated norm's),
    norm_before_gate, dt_min / dt_max / dt_init_floor (dt_bias's init range), dt_limit ([low, high or null]: dt's
    clamp), backend (auto, torch, mamba_ssm). Under `attention.doc_mask` the state (and the conv window) resets at each
    document start."""

    # head=mlm refuses it: a recurrence over the past
    causal_only = "mixer=mamba2 carries the past forward in its state: it has no bidirectional form"

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, pattern: list | None = None,
                 d_state: PositiveInt = 64, expand: PositiveInt = 2, head_dim: PositiveInt = 32,
                 n_groups: PositiveInt = 1, conv_size: PositiveInt = 4, chunk_size: PositiveInt = 64,
                 norm_eps: PositiveFloat = 1e-5, norm_before_gate: bool = False, dt_min: PositiveFloat = 1e-3,
                 dt_max: PositiveFloat = 0.1, dt_init_floor: PositiveFloat = 1e-4,
                 dt_limit: Annotated[tuple[float, float | None], Range(ge=0)] = (0.0, None),
                 backend: Literal["auto", "torch", "mamba_ssm"] = "auto") -> None:
        super().__init__()
        self.d_inner, self.n_heads = _sizes(cfg, expand, head_dim, n_groups)
        self.backend = MixerBackend("mamba2", backend, "mamba_ssm")
        self.d_state, self.head_dim, self.n_groups, self.chunk_size = d_state, head_dim, n_groups, chunk_size
        self.norm_eps, self.norm_before_gate, self.dt_limit = norm_eps, norm_before_gate, tuple(dt_limit)
        self.doc_reset = bool(cfg.attention.get("doc_mask"))
        H, GN = self.n_heads, n_groups * d_state
        self.conv_dim = self.d_inner + 2 * GN
        self.in_proj = nn.Linear(cfg.d_model, 2 * self.d_inner + 2 * GN + H, bias=cfg.bias)
        self.in_proj.fused = (self.d_inner, self.d_inner, GN, GN, H)  # z, x, B, C, dt rows (read by the inits)
        self.in_proj.value_parts = (False, True, False, False, False)  # x carries the values (DeepNet's gain)
        self.conv = ShortConv(self.conv_dim, conv_size, bias=True)
        nn.init.zeros_(self.conv.conv.bias)  # as HF's _init_weights
        self.dt_bias = nn.Parameter(log_uniform_dt_bias(H, dt_min, dt_max, dt_init_floor))  # softplus(dt_bias) = dt
        self.A_log = nn.Parameter(torch.log(torch.arange(1, H + 1, dtype=torch.float32)))  # A = -exp(A_log) = -1..-H
        self.D = nn.Parameter(torch.ones(H))
        self.norm_weight = nn.Parameter(torch.ones(self.d_inner))  # the gated RMSNorm's gain (HF: norm.weight)
        self.out_proj = nn.Linear(self.d_inner, cfg.d_model, bias=cfg.bias)
        self.out_proj.is_residual_proj = True  # read by the init schemes (GPT-2's 1/sqrt(2L) scaling)
        self._figures: dict[str, torch.Tensor] = {}

    @classmethod
    def geometry(cls, cfg: GPTConfig, *, d_state: int = 64, expand: int = 2, head_dim: int = 32, n_groups: int = 1,
                 conv_size: int = 4, chunk_size: int = 64, **_) -> MixerGeometry:
        """Weights: in_proj, the conv (and its bias), dt_bias, A_log, D, the norm's gain, out_proj (exact). State: h
        per head and the conv's last k - 1 inputs. FLOPs per token of the chunked form (c the chunk, p head_dim, N
        d_state, per head): the (c × c) scores C·B and their product with x (2·c·(N + p)), the chunk's state and the
        state's read-out (2 · 2·p·N); plus the conv (2·k per channel). Elementwise work (decays, norm) left out."""
        d_inner, H = _sizes(cfg, expand, head_dim, n_groups)
        conv_dim = d_inner + 2 * n_groups * d_state
        proj = 2 * d_inner + 2 * n_groups * d_state + H
        n = (cfg.d_model * proj + conv_dim * (conv_size + 1) + 3 * H + d_inner + d_inner * cfg.d_model
             + cfg.bias * (proj + cfg.d_model))
        flops = H * (2 * chunk_size * (d_state + head_dim) + 4 * head_dim * d_state) + 2 * conv_size * conv_dim
        return MixerGeometry(n_params=n, state_numbers=H * head_dim * d_state + (conv_size - 1) * conv_dim,
                             flops_per_token=flops)

    def forward(self, x: torch.Tensor, pos: object = None, cache: LayerCache | None = None,
                doc: torch.Tensor | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        H, P, N, G = self.n_heads, self.head_dim, self.d_state, self.n_groups
        path = self.backend.choose(x)
        state, starts, dtype = recurrent_inputs(x, cache, doc, self.doc_reset)
        z, xBC, dt = self.in_proj(x).split((self.d_inner, self.conv_dim, H), dim=-1)
        xBC, conv_state = self.conv(xBC, state.get("conv"), starts)
        with torch.autocast(x.device.type, enabled=False):
            dt = F.softplus(dt.to(dtype) + self.dt_bias.to(dtype)).clamp(*self.dt_limit)  # (B, T, H)
            A = -torch.exp(self.A_log.to(dtype))
            if path == "mamba_ssm":
                xs, Bm, Cm = xBC.split((self.d_inner, G * N, G * N), dim=-1)
                y, ssm = mamba_ssm_scan(xs.reshape(B, T, H, P), dt, A, Bm.reshape(B, T, G, N),
                                        Cm.reshape(B, T, G, N), self.D.to(dtype), self.chunk_size,
                                        state.get("ssm"), starts)
                y, ssm = y.to(dtype).reshape(B, T, self.d_inner), ssm.to(dtype)
            else:
                xs, Bm, Cm = xBC.to(dtype).split((self.d_inner, G * N, G * N), dim=-1)
                xs = xs.reshape(B, T, H, P)
                Bm, Cm = (t.reshape(B, T, G, N).repeat_interleave(H // G, dim=2) for t in (Bm, Cm))  # (B, T, H, N)
                y, ssm = ssd(xs, dt, A, Bm, Cm, self.chunk_size, state.get("ssm"), starts)
                y = (y + self.D.to(dtype)[:, None] * xs).reshape(B, T, self.d_inner)
            y = self.gated_norm(y, z.to(dtype))
        state.update(conv=conv_state, ssm=ssm)
        self._figures = {"state_norm": ssm.detach().flatten(2).norm(dim=-1).mean(),
                         "gate_mean": torch.exp(dt.detach() * A.detach()).mean(), "dt_mean": dt.detach().mean()}
        return self.out_proj(y.to(x.dtype))

    def gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm per group of d_inner / G channels of y ⊙ silu(z) (norm_before_gate: of y, then ⊙ silu(z)), times
        the gain."""
        if not self.norm_before_gate:
            y = y * F.silu(z)
        g = y.unflatten(-1, (self.n_groups, -1))
        y = (g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.norm_eps)).flatten(-2) * self.norm_weight
        return y * F.silu(z) if self.norm_before_gate else y

    def figures(self) -> dict[str, torch.Tensor]:
        """The last forward's mean final-state norm ‖h‖_F (over sequences and heads), mean decay exp(dt·A) and mean
        dt (over tokens and heads)."""
        return dict(self._figures)


def ssd(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, chunk: int,
        state: torch.Tensor | None = None, starts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan, chunked: x (b, T, h, p), dt (b, T, h), A (h,), B and C (b, T, h, N), from `state` (b, h, p, N)
    (zeros when None); `starts` (b, T): document starts, where the state is emptied. Returns y (b, T, h, p) without
    the D skip, and the final state. T is padded to a multiple of the chunk with dt = 0 (no decay, no input)."""
    b, T, h, p = x.shape
    c = min(chunk, T)
    n = -(-T // c)
    pad = n * c - T

    def chunks(t: torch.Tensor) -> torch.Tensor:  # (b, T, h, ...) -> (b, h, n, c, ...)
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
        return t.reshape(b, n, c, *t.shape[2:]).movedim(3, 1)

    a = chunks(dt * A)  # (b, h, n, c): log decays
    xd, B, C = chunks(x * dt[..., None]), chunks(B), chunks(C)  # (b, h, n, c, p / N)
    causal = torch.ones(c, c, dtype=torch.bool, device=x.device).tril()
    # segsum[i, j] = Σ_{j<k≤i} a_k (0 for i <= j), summed directly rather than as a difference of cumsums
    segsum = a[..., :, None].expand(*a.shape, c).masked_fill(~causal.tril(-1), 0).cumsum(-2)
    mask = causal.expand(b, 1, n, c, c)
    carry = last = torch.ones(b, 1, n, c, dtype=torch.bool, device=x.device)  # state reaches i / j reaches the end
    if starts is not None:
        seg = F.pad(starts, (0, pad)).reshape(b, 1, n, c).long().cumsum(-1)  # documents begun in the chunk so far
        mask = mask & (seg[..., :, None] == seg[..., None, :])
        carry, last = seg == 0, seg == seg[..., -1:]
    L = torch.exp(segsum) * mask  # (b, h, n, c, c): decay from j to i, zero across documents and above the diagonal
    y = ((C @ B.transpose(-1, -2)) * L) @ xd  # within the chunks
    to_end = torch.exp(segsum[..., -1, :]) * last  # (b, h, n, c): decay from j to the chunk's end
    chunk_states = (xd * to_end[..., None]).transpose(-1, -2) @ B  # (b, h, n, p, N)
    keep = torch.exp(a.sum(-1)) * carry[..., -1]  # (b, h, n): what of the incoming state the chunk's end keeps
    S = x.new_zeros(b, h, p, B.size(-1)) if state is None else state.to(x.dtype)
    incoming = []
    for k in range(n):  # the inter-chunk recurrence, one step per chunk
        incoming.append(S)
        S = keep[:, :, k, None, None] * S + chunk_states[:, :, k]
    decay_in = torch.exp(a.cumsum(-1)) * carry  # (b, h, n, c): decay from the chunk's start to i
    y = y + (C @ torch.stack(incoming, 2).transpose(-1, -2)) * decay_in[..., None]
    return y.movedim(1, 3).reshape(b, n * c, h, p)[:, :T], S


def mamba_ssm_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   D: torch.Tensor, chunk: int, state: torch.Tensor | None, starts: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan with D's skip on mamba-ssm's kernel: x (b, T, h, p), dt (b, T, h) (softplus and clamp applied), A
    and D (h,), B and C (b, T, G, N) per group, from `state` (b, h, p, N) or zeros; `starts` (b, T): document starts,
    as the kernel's seq_idx (0 before the first: only those tokens read the state). Returns y + D·x and the final
    state."""
    scan = kernel("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
    seq_idx = None if starts is None else starts.cumsum(1, dtype=torch.int32)
    return scan(x, dt, A, B, C, chunk, D=D, initial_states=state, seq_idx=seq_idx, return_final_states=True)


# our name -> HF's (Mamba2Mixer, NemotronHMamba2Mixer, BambaMixer); the biases exist where model.bias / use_bias
HF_NAMES = {"in_proj.weight": "in_proj.weight", "in_proj.bias": "in_proj.bias", "conv.conv.weight": "conv1d.weight",
            "conv.conv.bias": "conv1d.bias", "dt_bias": "dt_bias", "A_log": "A_log", "D": "D",
            "norm_weight": "norm.weight", "out_proj.weight": "out_proj.weight", "out_proj.bias": "out_proj.bias"}


def from_hf_state(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """A HF Mamba-2 mixer's weights (its state_dict, keys under `prefix`, e.g. "backbone.layers.0.mixer.") as this
    module's state_dict: the same tensors, renamed."""
    return {ours: state[prefix + hf] for ours, hf in HF_NAMES.items() if prefix + hf in state}


def hf_state(state: Mapping[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """This module's state_dict as a HF Mamba-2 mixer's (keys under `prefix`): the inverse of `from_hf_state`."""
    return {prefix + hf: state[ours] for ours, hf in HF_NAMES.items() if ours in state}


def _sizes(cfg: GPTConfig, expand: int, head_dim: int, n_groups: int) -> tuple[int, int]:
    """(d_inner, heads), checked: head_dim divides d_inner, n_groups divides the heads."""
    d_inner = expand * cfg.d_model
    if d_inner % head_dim:
        raise ValueError(f"mixer.head_dim={head_dim} does not divide d_inner = mixer.expand·model.d_model = "
                         f"{d_inner}; use one of {[d for d in range(1, d_inner + 1) if d_inner % d == 0]}")
    H = d_inner // head_dim
    if H % n_groups:
        raise ValueError(f"mixer.n_groups={n_groups} does not divide the {H} heads (d_inner / mixer.head_dim); use one "
                         f"of {[g for g in range(1, H + 1) if H % g == 0]}")
    return d_inner, H


OPTIONS = {"mamba2": Mamba2}
