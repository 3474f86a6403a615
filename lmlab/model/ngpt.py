"""norm=ngpt: the normalized Transformer (nGPT; Loshchilov, Hsieh, Sun & Ginsburg, 2024, arXiv 2410.01131, §2), every
vector of the model on the unit sphere. With Norm(x) = x / ‖x‖ over d_model:

    h⁰ = Norm(embedding output)                       the embedding, position tables and head rows unit vectors too
    h ← Norm(h + α_A ⊙ (Norm(Attn(h)) − h))           no norm layer inside the block: h is unit already
    h ← Norm(h + α_M ⊙ (Norm(MLP(h)) − h))            α_A, α_M ∈ R^d: the "eigen learning rates" of each block
    attention: q ← Norm(q)·s_qk, k ← Norm(k)·s_qk per head after RoPE, softmax(√d_k · q·k) (not 1/√d_k)
    MLP:       u ← u·s_u, v ← v·s_v·√d_model, out = W_o (u ⊙ SiLU(v))   (ffn=mlp: act(v·s_v·√d_model), its one part)
    logits:    z = s_z ⊙ (E_out h)                    no final norm: h is unit

Every matrix is normalised along its d_model dimension at init and after every optimizer step (`normalize_weights`,
which the training loop calls): the rows of the embedding, the position table, the head and each Linear that reads the
stream (W_q, W_k, W_v, the MLP's up and gate), the columns of each that writes into it (W_o of attention and MLP:
`is_residual_proj`). Weight decay has nothing to shrink on renormalised matrices and the paper trains without it: the
model says so (`decays`), and the optimizer groups take none. The learned vectors (α, s_qk, s_u, s_v, s_z) are stored
with the paper's trick: the parameter starts at `scale` and is read times init/scale, so it starts at `init` while
Adam's steps on it, of about the same size for every parameter, move the value init/scale times as far (α: 0.05 from a
parameter at 1/√d_model). s_qk is per key/value head and head dimension (per head under MHA, the paper's; under GQA a
group's query heads share their key head's). nGPT wires the pre placement's blocks itself (`Block.set_wiring`) and
refuses by key what it is not defined with (`TAKES`, `check`, `check_run`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lmlab.model.capabilities import marks
from lmlab.model.position.base import Position
from lmlab.registry import PositiveFloat, option_defaults

if TYPE_CHECKING:
    from lmlab.config import GPTConfig

# What nGPT is defined with, by group: the other options are refused by key. `pre` is the placement whose blocks it
# rewires (their sublayers read the unit stream as it is); the attention options whose q and k are MHA's (a head count
# apart); the positions that leave the stream and the q/k norms alone (RoPE rotates, norms unchanged; the biases add to
# the logits) or whose table is a matrix it normalises (learned).
TAKES = {"placement": ("pre",), "block": ("transformer",), "mixer": ("attention",), "attention": ("mha", "gqa", "mqa"),
         "position": ("none", "rope", "learned", "alibi", "t5", "fire"), "param": ("sp",), "head": ("next",)}
WHY = {"placement": "it wires each block itself, h ← Norm(h + α ⊙ (Norm(F(h)) − h)), on the pre placement's blocks",
       "block": "its update and scales are defined for attention + FFN layers",
       "mixer": "a recurrent mixer's matrices and state have no form on the sphere here",
       "attention": "it puts MHA's q and k on the sphere (after RoPE) and scales them by s_qk",
       "position": "the embedding output is normalised, so a table added to it must be one it keeps on the sphere "
                   "(learned), and a rotation of q and k must keep their norms (rope)",
       "param": "its scales are its own (√d_k logits, s_z, weights on the sphere), not µP's",
       "head": "the extra depths' blocks would not be on the sphere"}
EPS = 1e-12  # Norm divides by max(‖x‖, EPS): only an all-zero vector reaches it


def unit(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Norm(x) = x / ‖x‖ along `dim`, computed in fp32 at least, in x's dtype."""
    xf = x if x.dtype in (torch.float32, torch.float64) else x.float()
    return (xf / torch.linalg.vector_norm(xf, dim=dim, keepdim=True).clamp_min(EPS)).to(x.dtype)


def stored(shape: tuple[int, ...], init: float, scale: float) -> tuple[nn.Parameter, float]:
    """The paper's trick: a parameter filled with `scale` and the factor init/scale it is read with (value = init)."""
    return nn.Parameter(torch.full(shape, float(scale))), init / scale


def check(cfg: GPTConfig) -> None:
    """Refuse, by key, what nGPT is not defined with (before training: the model is built on the meta device)."""
    chosen = {"placement": cfg.placement, "block": cfg.block, "mixer": cfg.mixer, "attention": cfg.attention,
              "position": cfg.position, "param": cfg.param, "head": cfg.head}
    for group, takes in TAKES.items():
        if (name := chosen[group].get("name")) not in takes:
            raise ValueError(f"norm=ngpt with {group}={name}: {WHY[group]}; use {group}={'|'.join(takes)}")
    if extra := [name for name in cfg.residual if name != "standard"]:
        raise ValueError(f"norm=ngpt with residual={extra[0]}: nGPT's update is the whole stream rule (a residual "
                         f"option adds to the stream or rewires the block); use residual=standard")
    if "none" in (cfg.mixer.get("pattern") or []) or cfg.ffn.get("skip_layers"):
        key = "mixer.pattern" if "none" in (cfg.mixer.get("pattern") or []) else "ffn.skip_layers"
        raise ValueError(f"norm=ngpt with {key} dropping a sublayer: nGPT's update moves the stream toward each "
                         f"sublayer's output with its own learned rate; give every layer attention and an FFN")
    if cfg.ffn.get("name") == "moe":
        raise ValueError("norm=ngpt with ffn=moe: its s_u, s_v and normalised matrices are a dense FFN's; use "
                         "ffn=mlp|glu|swiglu|geglu|reglu (swiglu is the paper's)")
    attn = cfg.attention
    for key, plain, why in (("qk_norm", False, "nGPT normalises q and k itself (after RoPE, times s_qk)"),
                            ("mem_kv", 0, "memory keys would not be on the sphere")):
        if attn.get(key, plain) != plain:
            raise ValueError(f"norm=ngpt with attention.{key}={_shown(attn[key])}: {why}; use attention.{key}="
                             f"{_shown(plain)}")
    for key, value, plain, why in (
            ("bias", cfg.bias, False, "its matrices have no biases (a bias would stay off the sphere)"),
            ("dropout", cfg.dropout, 0.0, "a dropped branch leaves the sphere; the paper trains without"),
            ("embed_scale", cfg.embed_scale, None, "the embedding output is normalised, which undoes any factor"),
            ("embed_scale_learned", cfg.embed_scale_learned, False, "the normalised embedding undoes the factor")):
        if value != plain:
            raise ValueError(f"norm=ngpt with model.{key}={_shown(value)}: {why}; use model.{key}={_shown(plain)}")


def _shown(value: Any) -> str:
    """A value as the command line writes it (null, true, 0.1)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_run(optim: dict[str, Any], strategy: str | None, averages: bool) -> None:
    """Refuse the training loop's settings nGPT cannot run with (before training): weights that are an average (a
    weight EMA; an optimizer whose evaluation weights are one, `averages`: schedule-free's) are off the sphere, the
    renormalisation reads whole matrices (FSDP shards them), and QK-clip rescales what the sphere undoes. A weight
    decay is not applied (`Sphere.decays`): said once here."""
    if ema := optim.get("ema"):
        raise ValueError(f"norm=ngpt with optim.ema={ema}: an average of unit vectors is off the sphere, so the EMA's "
                         f"weights are not an nGPT; use optim.ema=0")
    if averages:
        raise ValueError(f"norm=ngpt with optim={optim.get('name')}: its evaluation weights are an average of the "
                         f"iterates, off the sphere; use optim=adamw (or another optimizer that steps the weights)")
    if strategy in ("FSDP2Strategy", "fsdp"):
        raise ValueError(f"norm=ngpt with trainer={'fsdp2' if strategy == 'FSDP2Strategy' else 'fsdp'}: every step "
                         f"renormalises whole rows and columns of each matrix, which FSDP shards; use trainer=ddp")
    if (tau := optim.get("qk_clip")) is not None:
        raise ValueError(f"norm=ngpt with optim.qk_clip={tau}: q and k are on the unit sphere (logits at most "
                         f"√d_k·s_qk²); rescaling W_q and W_k changes nothing; use optim.qk_clip=null")
    if wd := optim.get("weight_decay"):
        import warnings

        warnings.warn(f"optim.weight_decay={wd} does not apply under norm=ngpt: its matrices are renormalised after "
                      f"every step (the paper trains without decay)", stacklevel=3)


class NGPT(nn.Module):
    """The norm group's option: at each norm site Norm(x) = x / ‖x‖, no gain (the blocks' ln_1, ln_2 are the Norm of
    the update); `attach` makes the model nGPT around it. Its keys are nGPT's scales: each vector's value at init and
    its storage scale (null: 1/√d_model, the paper's)."""

    placements = TAKES["placement"]  # the placements whose blocks it wires
    check_run = staticmethod(check_run)  # the training loop's settings it refuses (lmlab.run.checks)

    def __init__(self, dim: int, *, alpha_init: PositiveFloat = 0.05, alpha_scale: PositiveFloat | None = None,
                 sqk_init: PositiveFloat = 1.0, sqk_scale: PositiveFloat | None = None,
                 suv_init: PositiveFloat = 1.0, suv_scale: PositiveFloat | None = 1.0,
                 sz_init: PositiveFloat = 1.0, sz_scale: PositiveFloat | None = None) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return unit(x)

    @classmethod
    def attach(cls, model: nn.Module, **keys: Any) -> Sphere:
        """Make the built `model` nGPT: refuse what it is not defined with, wire every block, give every attention its
        q/k map and √d_k scale and every FFN its s_u, s_v; return the model-wide part (s_z, the weights' sphere)."""
        cfg = model.cfg
        check(cfg)
        d = cfg.d_model
        keys = {**option_defaults(cls), **keys}
        init = {k: keys[f"{k}_init"] for k in ("alpha", "sqk", "suv", "sz")}
        scale = {k: d ** -0.5 if keys[f"{k}_scale"] is None else keys[f"{k}_scale"] for k in init}
        model.ln_e = cls(d)  # the embedding output on the sphere (a position table's sum too)
        model.ln_f = nn.Identity()  # no final norm: the stream is unit
        for block in model.h:
            block.set_wiring("ngpt", EigenUpdate(len(block.sublayer_names), d, init["alpha"], scale["alpha"]), "ngpt")
            attn, ffn = block.attn, block.mlp
            attn.qk_map = SphereQK(attn.n_kv_head, attn.n_head // attn.n_kv_head, attn.head_dim, init["sqk"],
                                   scale["sqk"])
            attn.scale *= attn.head_dim  # 1/(√d_k·temperature) → √d_k/temperature
            attn.no_qk_clip = "norm=ngpt puts q and k on the unit sphere; rescaling W_q and W_k changes nothing"
            parts = marks(ffn.c_fc).fused or (ffn.c_fc.out_features,)  # GLU: (gate, up); MLP: (hidden,)
            ffn.hidden_scale = HiddenScale(parts, d, init["suv"], scale["suv"])
        return Sphere(cfg.padded_vocab, init["sz"], scale["sz"])


class EigenUpdate(nn.Module):
    """A block's wiring (lmlab.model.placement.Block.set_wiring): sublayer j moves the unit stream towards its
    normalised output by α_j per channel, h ← Norm(h + α_j ⊙ (Norm(F_j(h)) − h)), Norm being the block's norm (NGPT)."""

    def __init__(self, n_sublayers: int, d: int, init: float, scale: float) -> None:
        super().__init__()
        self.alpha, self.alpha_mult = stored((n_sublayers, d), init, scale)

    def rates(self) -> torch.Tensor:
        """α (n_sublayers, d): the stored parameter times init/scale."""
        return self.alpha * self.alpha_mult

    def wire(self, block: nn.Module, x: torch.Tensor, fs: list) -> torch.Tensor:
        alpha = self.rates().to(x.dtype)
        for j, f in fs:
            norm = block.norm(j)
            x = norm(x + alpha[j - 1] * (norm(f(x)) - x))
        return x


class SphereQK(nn.Module):
    """An attention's q/k map (MHA's `qk_map`, after the position scheme's rotation): each head's query and key on the
    unit sphere, times s_qk (n_kv_head, head_dim), a key head's shared by the query heads of its group."""

    def __init__(self, n_kv_head: int, group: int, head_dim: int, init: float, scale: float) -> None:
        super().__init__()
        self.group = group
        self.s_qk, self.s_qk_mult = stored((n_kv_head, head_dim), init, scale)

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, nh, T, hs), k (B, nkv, T, hs) -> the same, on the sphere and scaled."""
        s = (self.s_qk * self.s_qk_mult).to(q.dtype)  # (nkv, hs)
        return unit(q) * s.repeat_interleave(self.group, dim=0)[:, None], unit(k) * s[:, None]


class HiddenScale(nn.Module):
    """An FFN's `hidden_scale`, on its first projection's outputs: the GLU's gate v·s_v·√d_model and up u·s_u (its
    c_fc rows [gate; up]), the MLP's one part v·s_v·√d_model (the input of its activation, as the GLU's gate)."""

    def __init__(self, parts: tuple[int, ...], d: int, init: float, scale: float) -> None:
        super().__init__()
        self.sqrt_d = math.sqrt(d)
        self.s_v, self.s_mult = stored((parts[0],), init, scale)
        self.s_u = stored((parts[1],), init, scale)[0] if len(parts) > 1 else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        s = self.s_v * (self.s_mult * self.sqrt_d)
        if self.s_u is not None:
            s = torch.cat((s, self.s_u * self.s_mult))
        return h * s.to(h.dtype)


class Sphere(nn.Module):
    """nGPT's model-wide part (the GPT's `norm_model`): the logits' scale s_z (vocab,), folded into the head's rows
    (s_z ⊙ (W h) = (s_z[:, None] ⊙ W) h, so every loss path and generation reads it), and the sphere every matrix is
    kept on."""

    decays = False  # weight decay has nothing to shrink on matrices renormalised after every step
    vocab_rows = ("s_z",)  # a scale per vocabulary id (model.vocab_pad's rows left out of the export)

    def __init__(self, vocab_size: int, init: float, scale: float) -> None:
        super().__init__()
        self.s_z, self.s_z_mult = stored((vocab_size,), init, scale)

    def head_weight(self, w: torch.Tensor) -> torch.Tensor:
        return w * (self.s_z * self.s_z_mult).to(w.dtype)[:, None]

    @torch.no_grad()
    def normalize_weights(self, model: nn.Module) -> None:
        """Every matrix along its d_model dimension: the rows of each embedding table (tokens, positions) and of each
        Linear that reads the stream, the columns of each that writes into it (`is_residual_proj`); a tied head once."""
        d = model.cfg.d_model
        # a position scheme that adds nothing to the stream acts on the logits (T5's bucket biases, FIRE's MLP): its
        # weights stay as they are; one that embeds (a learned table) is a stream matrix like the others
        on_logits = type(model.pos).embed is Position.embed
        seen = {id(m.weight) for m in model.pos.modules() if isinstance(m, (nn.Linear, nn.Embedding)) and on_logits}
        for m in model.modules():
            if not isinstance(m, (nn.Linear, nn.Embedding)) or id(m.weight) in seen:
                continue
            seen.add(id(m.weight))
            dim = 0 if marks(m).is_residual_proj else 1
            if m.weight.size(dim) != d:
                raise ValueError(f"norm=ngpt: {type(m).__name__} of shape {tuple(m.weight.shape)} has no d_model "
                                 f"({d}) side along dim {dim} to put on the sphere")
            m.weight.copy_(unit(m.weight, dim))
