"""attention=mla: multi-head latent attention (`MLA`) and its sizes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.attention.mha import MHA, Geometry
from lmlab.model.attention.parts import Widths, parts_geometry
from lmlab.registry import PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import LayerCache
    from lmlab.model.position import Position


class MLA(MHA):
    """Multi-head latent attention (DeepSeek-AI, 2024, DeepSeek-V2; V3). Keys and values come from one latent c of
    `kv_lora_rank` numbers per token, c = RMSNorm(x W_DKV), up-projected per head, [k_nope; v] = c W_UKV; the position
    is carried by a decoupled key part of `qk_rope_head_dim` numbers shared by all heads, k_rope = RoPE(x W_KR), so
    the KV cache holds only c and k_rope: `kv_lora_rank + qk_rope_head_dim` numbers per token and layer instead of
    MHA's 2·n_head·head_dim. Queries are [q_nope; RoPE(q_rope)] per head, from x W_Q, or from a compressed
    c_q = RMSNorm(x W_DQ) of `q_lora_rank` numbers (V2/V3: q = c_q W_UQ). Each head's logits read q_nope·k_nope +
    q_rope·k_rope, scaled by 1/sqrt(qk_nope_head_dim + qk_rope_head_dim), and weigh values of `v_head_dim`. The
    latent norms are RMSNorm with a gain and eps 1e-6, as DeepSeek's; under model.bias, the down projections and the
    output have biases and the up projections none (transformers' DeepseekV3). Unset sizes follow DeepSeek-V2's
    proportions to the head size d = d_model / n_head: qk_nope_head_dim = v_head_dim = d, qk_rope_head_dim = d / 2,
    kv_lora_rank = 4·d (at most d_model), q_lora_rank none (a full query projection, as V2-Lite). The cached latents
    are up-projected at every step (no weight absorption): the cache is small, the compute MHA's. qk_norm does not
    apply (the latents are normalised)."""

    scaled_dot_product = False  # its own formula: keys and values from a latent (tests/unit/model/attention/test_mla.py)
    runs_hooks = MHA.runs_hooks - {"before_rotation", "rotation", "after_rotation"}  # its own q and k (`latents`)
    refuses = {"paired_heads": "attention=mla caches a latent and one rotated key part shared by every head, which "
                               "pairing would rotate at two positions per token (its heads' slots)",
               **dict.fromkeys(("qk_norm", "qk_norm_eps"), "attention=mla normalises its latents (RMSNorm on "
                               "c_kv and c_q) and has no q/k norm"),
               "key_offset": "attention=mla builds its keys from a latent, their rotated part shared by every head: "
                             "the speedrun's shift of a head's unrotated key dims has no form here (use "
                             "attention=mha|gqa|mqa)"}

    def __init__(self, cfg: GPTConfig, layer: int = 0, *, kv_lora_rank: PositiveInt | None = None,
                 q_lora_rank: PositiveInt | None = None, qk_rope_head_dim: PositiveInt | None = None,
                 qk_nope_head_dim: PositiveInt | None = None, v_head_dim: PositiveInt | None = None,
                 **shared: Any) -> None:
        if cfg.position.get("window_yarn"):  # its rotated part is a slice of each query: a scale there is partial
            raise ValueError("attention=mla rotates only a slice of each query (q_rope): position.window_yarn=true, "
                             "which scales the whole attention logit through the rotation, has no form here; use "
                             "attention=mha|gqa|mqa, or position.window_yarn=false")
        # read by `project`, which the base class calls (a plain attribute may be set before nn.Module.__init__)
        self.sizes = mla_sizes(cfg, kv_lora_rank=kv_lora_rank, q_lora_rank=q_lora_rank,
                               qk_rope_head_dim=qk_rope_head_dim, qk_nope_head_dim=qk_nope_head_dim,
                               v_head_dim=v_head_dim)
        super().__init__(cfg, layer, **shared)

    @staticmethod
    def kv_heads(n_head: int, n_kv_head: int | None) -> int:
        return n_head  # every head up-projects its own keys and values from the shared latent

    @classmethod
    def fill(cls, cfg: GPTConfig, spec: dict[str, Any]) -> dict[str, Any]:
        """The spec with its unset sizes worked out (`mla_sizes`): the record holds the numbers the model used."""
        return {**spec, **mla_sizes(cfg, **{k: spec.get(k) for k in MLA_SIZES})}

    def project(self, cfg: GPTConfig) -> tuple[int, int]:
        s, nh, d = self.sizes, self.n_head, cfg.d_model
        rank, rope, nope, v = s["kv_lora_rank"], s["qk_rope_head_dim"], s["qk_nope_head_dim"], s["v_head_dim"]
        self.rank, self.rope, self.nope, self.v = rank, rope, nope, v
        if s["q_lora_rank"] is None:
            self.q_proj, self.q_a = nn.Linear(d, nh * (nope + rope), bias=False), None
        else:
            self.q_proj = None
            self.q_a = nn.Linear(d, s["q_lora_rank"], bias=cfg.bias)  # W_DQ
            self.q_a_norm = nn.Parameter(torch.ones(s["q_lora_rank"]))
            self.q_b = nn.Linear(s["q_lora_rank"], nh * (nope + rope), bias=False)  # W_UQ and W_QR
        self.kv_a = nn.Linear(d, rank + rope, bias=cfg.bias)  # W_DKV and W_KR: the cached numbers
        self.kv_a_norm = nn.Parameter(torch.ones(rank))
        self.kv_b = nn.Linear(rank, nh * (nope + v), bias=False)  # W_UK and W_UV, per head [k_nope; v]
        self.kv_b.fused = (nope, v) * nh
        self.kv_b.value_parts = (False, True) * nh  # DeepNet's gain goes to the values
        self.c_proj = nn.Linear(nh * v, d, bias=cfg.bias)
        self.c_proj.is_residual_proj = True
        return nope + rope, v

    @torch.no_grad()
    def clip_logits(self, gamma: torch.Tensor) -> None:
        """QK-clip by Kimi K2's rule for MLA: head h's logit is q_nope·k_nope + q_rope·k_rope with k_rope shared by
        every head, so q_nope's and k_nope's rows (W_Q or W_UQ, W_UK) take √γ_h, q_rope's rows γ_h, and the shared
        latent and rotary key (W_DKV, W_KR) nothing: q·k, hence each logit of head h, becomes γ_h times itself. The
        memory keys (`mem_kv`) likewise: their nope part √γ_h, their rope part nothing."""
        g = gamma.to(torch.float32)
        root = g.sqrt()[:, None]
        q_rows = torch.cat((root.expand(-1, self.nope), g[:, None].expand(-1, self.rope)), dim=1).reshape(-1)
        q = self.q_proj if self.q_a is None else self.q_b  # neither has a bias
        q.weight.mul_(q_rows.to(q.weight)[:, None])
        kv_rows = torch.cat((root.expand(-1, self.nope), torch.ones(len(g), self.v, device=g.device)), dim=1)
        self.kv_b.weight.mul_(kv_rows.reshape(-1).to(self.kv_b.weight)[:, None])
        # keys the parts hold (mem_kv's (n_head, M, nope + rope))
        self.parts.scale_keys(self, torch.cat((root.expand(-1, self.nope), torch.ones(len(g), self.rope,
                                                                                     device=g.device)), dim=1))

    @classmethod
    def geometry(cls, cfg: GPTConfig, **params: Any) -> Geometry:
        s = mla_sizes(cfg, **{k: params.get(k) for k in MLA_SIZES})
        nh, d, b = cfg.n_head, cfg.d_model, cfg.bias
        rank, rope, nope, v, rq = (s[k] for k in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
                                                  "v_head_dim", "q_lora_rank"))
        q = d * nh * (nope + rope) if rq is None else d * rq + b * rq + rq * nh * (nope + rope)
        n = q + (d + b) * (rank + rope) + rank * nh * (nope + v) + nh * v * d + b * d
        parts_n, parts_cache = parts_geometry(cfg, Widths(nh, nh, nope + rope, v), params)
        return Geometry(heads=nh, head_dim=rope, cache_width=rank + rope + parts_cache,
                        attn_width=nh * (nope + rope + v), n_params=n + parts_n)

    def latents(self, x: torch.Tensor, pos: Position, offset: int, doc: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, nh, T, nope + rope) with its rope part rotated; the cached numbers: c (B, 1, T, kv_lora_rank),
        normalised, and the shared rotated key part k_rope (B, 1, T, rope)."""
        B, T, _ = x.shape
        q = self.q_proj(x) if self.q_a is None else self.q_b(F.rms_norm(self.q_a(x), (self.q_a.out_features,),
                                                                         self.q_a_norm, eps=1e-6))
        q_nope, q_rope = q.view(B, T, self.n_head, self.nope + self.rope).transpose(1, 2).split(
            (self.nope, self.rope), dim=-1)
        c, k_rope = self.kv_a(x).split((self.rank, self.rope), dim=-1)
        c = F.rms_norm(c, (self.rank,), self.kv_a_norm, eps=1e-6)[:, None]  # one "head": shared by all
        q_rope, k_rope = pos.rotate(q_rope, k_rope[:, None], offset, doc, self.layer)
        return torch.cat((q_nope, q_rope), dim=-1), c, k_rope

    def qkv(self, x: torch.Tensor, pos: Position, offset: int = 0, doc: torch.Tensor | None = None,
            cache: LayerCache | None = None, mix: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, c, k_rope = self.latents(x, pos, offset, doc)
        if cache is not None:
            c, k_rope = cache.append(c, k_rope)  # the latents only: (B, 1, S, rank), (B, 1, S, rope)
        B, _, S, _ = c.shape
        k_nope, v = self.kv_b(c[:, 0]).view(B, S, self.n_head, self.nope + self.v).transpose(1, 2).split(
            (self.nope, self.v), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, self.n_head, S, self.rope)), dim=-1)
        return self.scale_queries(q, offset, doc, pos.causal), k, v


MLA_SIZES = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def mla_sizes(cfg: GPTConfig, **sizes: int | None) -> dict[str, int | None]:
    """MLA's sizes with the unset ones at DeepSeek-V2's proportions to the head size d (`MLA`), checked: a rank is
    a compression, at most d_model (the rule stated in the error), and the RoPE part has an even size."""
    d = cfg.head_dim
    out = {"kv_lora_rank": sizes.get("kv_lora_rank") or min(4 * d, cfg.d_model),
           "q_lora_rank": sizes.get("q_lora_rank"),
           "qk_rope_head_dim": sizes.get("qk_rope_head_dim") or max(2, 2 * (d // 4)),
           "qk_nope_head_dim": sizes.get("qk_nope_head_dim") or d, "v_head_dim": sizes.get("v_head_dim") or d}
    for key in ("kv_lora_rank", "q_lora_rank"):
        if out[key] is not None and out[key] > cfg.d_model:
            raise ValueError(f"attention.{key}={out[key]} is larger than model.d_model={cfg.d_model}: MLA's latent "
                             f"compresses the d_model numbers of a token; choose {key} <= {cfg.d_model}")
    if out["qk_rope_head_dim"] % 2:
        raise ValueError(f"attention.qk_rope_head_dim={out['qk_rope_head_dim']} must be even: RoPE rotates pairs")
    return out


OPTIONS = {"mla": MLA}
