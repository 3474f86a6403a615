"""Mixture of experts as an FFN option (`ffn=moe`): a router sends each token to `top_k` of `n_experts` FFNs of the
`expert` kind (mlp or any GLU, the `activation` group's as for the dense FFNs), plus `n_shared` always-on experts.

Routing (one token, router logits z = W_r x, E experts): scores s = softmax(z) (Shazeer et al., 2017; Mixtral) or
sigmoid(z) (DeepSeek-V3); the chosen experts are the top k of s + b, b the loss-free balancing bias (zero unless
`bias_update_rate`); their weights are s at the chosen experts, divided by their sum when `norm_topk` (Mixtral,
DeepSeek-V3) or not (Qwen1.5-MoE), then times `routed_scale` (DeepSeek-V3's routed_scaling_factor, 2.5 in its
release; the shared experts are not scaled). Dropless by default: every token reaches its k experts. With a
`capacity_factor` c an expert takes at most ceil(c · N·k / E) of a batch's N·k assignments, first come (token order)
first served (Switch Transformer); the others are dropped (they add nothing) and counted. Capacity applies to
training forwards only: evaluation and generation are dropless, so a token's output never depends on the other
tokens of its batch there (causality, and the KV cache's logits equal the full forward's).

Balancing, each an option, combinable:
- `balance_loss` α: the Switch/GShard load-balancing loss α · E · Σ_e f_e P_e, f_e the share of the N·k assignments
  routed to e, P_e the mean over tokens of p_e (p = softmax(z); for sigmoid scores s / Σ s): 1 at a uniform load;
- `router_z_loss` β: ST-MoE's β · mean over tokens of (log Σ_e exp z_e)², which keeps the router's logits small;
- `bias_update_rate` u: auxiliary-loss-free balancing (Wang et al., 2024; DeepSeek-V3): after each optimizer step
  b_e ← b_e + u · sign(mean load − load_e), load_e the step's assignments to e; b steers the choice only, never the
  weights. b is a buffer (`expert_bias`): saved in the checkpoint, restored exactly on resume.
The losses are the module's terms of the side channel (lmlab.model.side: `moe_balance_loss`, `router_z_loss`), summed
over the MoE layers (Switch, ST-MoE) and added to the objective by the GPT; their values before the coefficients are
logged apart from the LM loss.

Compute: one gather and one scatter per layer, all of it tensor ops of static shapes: no `.item()`, no bincount, no
loop over experts, nothing read back to the host, so a GPU never waits and torch.compile keeps the layer in one graph.
The N·k assignments are sorted by expert (a stable sort), the tokens gathered in that order, each expert's rows
multiplied by its own matrices in one grouped matmul (`F.grouped_mm` where torch runs it on this device and dtype;
else a batched matmul over E padded groups of N rows, `padded_linear`), weighted and added back to their tokens with one
index_add; capacity drops an assignment by giving it weight 0. The experts' weights are stacked in
`nn.Linear`s of E row blocks (`fused`, so fan-based inits treat each expert's matrices separately): c_fc (E·h, d) or
(E·2h, d) ([gate; up] per expert, as transformers' Mixtral stores gate_up_proj), c_proj (E·d, h). `active_share`
= k/E on them tells the FLOP count (lmlab.model.flops) how much of them a token uses.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from lmlab.model.activation import Activation
from lmlab.model.dense import DENSE_FFNS, GLU
from lmlab.model.side import Term
from lmlab.registry import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

SCORES = ("softmax", "sigmoid")
# The routing statistics one forward leaves (`MoE.stats`), all sums over tokens (so ranks add them up):
# counts (E) assignments per expert, prob (E) Σ p_e, then entropy Σ H(p), tokens N, dropped assignments, Σ (log Z)².
STAT_TAIL = ("entropy", "tokens", "dropped", "lse_sq")
BALANCE, ROUTER_Z = "moe_balance_loss", "router_z_loss"  # its side-channel terms: train/<name>, before coefficients


def expert_kind(name: str) -> type:
    """The FFN class of `ffn.expert` (a dense option: mlp, glu, swiglu, ...), or a ValueError naming the choices."""
    if name not in DENSE_FFNS:
        raise ValueError(f"ffn.expert={name!r} is not an expert kind; choose one of {sorted(DENSE_FFNS)}")
    return DENSE_FFNS[name]


def route(logits: torch.Tensor, top_k: int, score: str = "softmax", norm_topk: bool = True,
          bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (N, E) -> (chosen experts (N, k), their weights (N, k), p (N, E) the score distribution). The choice
    is the top k of s + bias, the weights s there (normalised to sum 1 with `norm_topk`); p is softmax(z), or s / Σ s
    for sigmoid scores (what the balance loss and the entropy read)."""
    logits = logits.float()
    s = torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)
    choice = s if bias is None else s + bias
    idx = choice.topk(top_k, dim=-1).indices  # (N, k)
    w = s.gather(1, idx)
    if norm_topk:
        w = w / w.sum(-1, keepdim=True)
    p = s if score == "softmax" else s / s.sum(-1, keepdim=True)
    return idx, w, p


def capacity(tokens: int, top_k: int, n_experts: int, factor: float | None) -> int | None:
    """The assignments an expert takes per batch: ceil(factor · N·k / E) (None: dropless)."""
    return None if factor is None else math.ceil(factor * tokens * top_k / n_experts)


def balance_loss(counts: torch.Tensor, prob_sum: torch.Tensor, tokens: float, top_k: int) -> torch.Tensor:
    """Switch/GShard: E · Σ_e f_e P_e, f_e = counts_e / (N·k), P_e = Σ_t p_e / N. 1 when the load is uniform."""
    E = counts.numel()
    return E * ((counts / (tokens * top_k)) * (prob_sum / tokens)).sum()


def bias_update(bias: torch.Tensor, load: torch.Tensor, rate: float) -> torch.Tensor:
    """DeepSeek-V3's loss-free balancing step: b + rate · sign(mean(load) − load)."""
    return bias + rate * torch.sign(load.mean() - load)


@functools.cache
def _grouped_mm_runs(device_type: str, dtype: torch.dtype) -> bool:
    """Whether F.grouped_mm runs forward and backward here (CPU in torch 2.13: every float dtype; CUDA: bf16 on
    recent GPUs). Tried once per device kind and dtype on a tiny problem."""
    try:  # with gradients whatever the caller's mode: a first call under no_grad would cache False for good
        with torch.inference_mode(False), torch.enable_grad():
            return _grouped_mm_probe(device_type, dtype)
    except (RuntimeError, NotImplementedError, TypeError, AttributeError):  # AttributeError: a torch without it
        return False


def _grouped_mm_probe(device_type: str, dtype: torch.dtype) -> bool:
    x = torch.randn(16, 16, device=device_type, dtype=dtype, requires_grad=True)
    w = torch.randn(2, 16, 16, device=device_type, dtype=dtype, requires_grad=True)
    y = F.grouped_mm(x, w.transpose(1, 2), offs=torch.tensor([8, 16], device=device_type, dtype=torch.int32))
    y.backward(torch.ones_like(y))
    return True


def expert_counts(chosen: torch.Tensor, n_experts: int) -> torch.Tensor:
    """(E,) the assignments of each expert: a scatter-add, not torch.bincount, which reads its input's maximum back
    to the host to size its output (a device sync on a GPU, a graph break under torch.compile)."""
    return torch.zeros(n_experts, dtype=torch.long, device=chosen.device).scatter_add_(0, chosen,
                                                                                         torch.ones_like(chosen))


@torch.compiler.assume_constant_result
def _grouped_here(device_type: str, dtype: torch.dtype) -> bool:
    """Whether the grouped matmul takes this call: where F.grouped_mm runs, and under torch.compile only in bf16 (its
    meta kernel, which the compiler traces, accepts bf16 alone in torch 2.13). A constant to the compiler: the probe
    runs eagerly once, never traced."""
    if device_type == "meta":
        return False
    return _grouped_mm_runs(device_type, dtype) and (dtype == torch.bfloat16 or not torch.compiler.is_compiling())


def _aligned(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """t zero-padded at the end of `dims` to a 16-byte multiple (F.grouped_mm's row strides): zeros add nothing to a
    product, so the result's first columns are the unpadded one's."""
    per = 16 // t.element_size()
    pad = [0] * (2 * t.dim())
    for d in dims:
        pad[2 * (t.dim() - 1 - d) + 1] = -t.size(d) % per
    return F.pad(t, pad) if any(pad) else t


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (M, in), rows sorted by expert (`offs` (E) the int32 end of each expert's rows, the last = M); w (E, out, in)
    -> (M, out): each expert's rows times its own matrix transposed, in one F.grouped_mm. Widths that are not a
    16-byte multiple are zero-padded (the tests' small models; real widths are aligned)."""
    out = w.size(1)
    y = F.grouped_mm(_aligned(x, (1,)), _aligned(w, (1, 2)).transpose(1, 2), offs=offs)
    return y[:, :out] if y.size(1) != out else y


def padded_linear(x: torch.Tensor, w: torch.Tensor, slot: torch.Tensor, slots: int) -> torch.Tensor:
    """The grouped matmul where F.grouped_mm does not run (fp32 under torch.compile, older devices): each expert's
    rows placed in its `slots` rows of an (E, slots, in) batch (row i at `slot[i]` = e·slots + its rank in e's rows;
    E·slots: a row past its expert's slots, which adds nothing), one batched matmul, the rows read back. Static
    shapes and no host sync, at the price of E·slots rows' work (dropless: slots = N, every token once per expert)."""
    E, out, inp = w.shape
    batch = x.new_zeros(E * slots + 1, inp).index_copy(0, slot, x)[:-1].view(E, slots, inp)
    y = torch.bmm(batch, w.transpose(1, 2)).reshape(E * slots, out)
    return torch.cat([y, y.new_zeros(1, out)]).index_select(0, slot)


class Experts(nn.Linear):
    """E matrices of (out, in) stacked as one (E·out, in) weight (and E·out bias): the storage of the experts' c_fc
    or c_proj. Not applied as one Linear: `stack()` gives the (E, out, in) view the grouped matmul reads."""

    def __init__(self, n_experts: int, in_features: int, out_features: int, bias: bool, blocks: tuple[int, ...],
                 active_share: float) -> None:
        super().__init__(in_features, n_experts * out_features, bias=bias)
        self.n_experts, self.out_per_expert = n_experts, out_features
        self.fused = blocks * n_experts  # each expert's matrices (GLU: gate, up), for fan-based inits
        self.active_share = active_share  # the share of these weights one token multiplies (lmlab.model.flops)

    def stack(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = self.weight.view(self.n_experts, self.out_per_expert, self.in_features)
        b = None if self.bias is None else self.bias.view(self.n_experts, self.out_per_expert)
        return w, b

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("Experts holds E matrices; MoE applies them grouped by expert (grouped_linear)")


class MoE(nn.Module):
    """A routed mixture of `n_experts` FFNs of kind `expert`, `top_k` per token, plus `n_shared` shared ones
    (DeepSeekMoE, Dai et al., 2024) whose output is gated by sigmoid(w·x) with `shared_gate` (Qwen2-MoE). Each
    expert's hidden size is the FFN group's (`ffn.hidden`, or `hidden_mult` matched to the expert kind as a dense FFN
    of that kind would be): `hidden_mult=1` makes fine-grained quarter-size experts. The n_shared shared experts act
    as one FFN of hidden n_shared·h (their sum; one output bias)."""

    hidden_ratio = 1.0
    sublayer = "ffn"
    routed = True  # read by the tests and sizing: not a dense FFN, its parameters are not matched to the MLP's

    def __init__(self, dim: int, hidden: int, *, activation: Mapping[str, Any], bias: bool = False,
                 expert: str = "mlp", n_experts: PositiveInt = 8, top_k: PositiveInt = 2,
                 n_shared: NonNegativeInt = 0, shared_gate: bool = False,
                 score: Literal["softmax", "sigmoid"] = "softmax", norm_topk: bool = True,
                 capacity_factor: PositiveFloat | None = None, balance_loss: NonNegativeFloat = 0.0,
                 router_z_loss: NonNegativeFloat = 0.0, bias_update_rate: NonNegativeFloat = 0.0,
                 routed_scale: PositiveFloat = 1.0) -> None:
        super().__init__()
        kind = expert_kind(expert)
        if top_k > n_experts:
            raise ValueError(f"ffn.top_k={top_k} > ffn.n_experts={n_experts}: a token cannot reach more experts than "
                             f"there are; choose top_k in 1..{n_experts}")
        if shared_gate and not n_shared:
            raise ValueError("ffn.shared_gate=true gates the shared experts' output: it needs ffn.n_shared >= 1")
        self.n_experts, self.top_k, self.score, self.norm_topk = n_experts, top_k, score, norm_topk
        self.capacity_factor, self.balance_coef, self.z_coef = capacity_factor, balance_loss, router_z_loss
        self.bias_update_rate, self.routed_scale = bias_update_rate, routed_scale
        self.glu = issubclass(kind, GLU)  # three matrices per expert: [gate; up] and down
        self.hidden = hidden
        self.act = Activation({"name": kind.gate} if self.glu and kind.gate else activation)
        self.router = nn.Linear(dim, n_experts, bias=False)
        share = top_k / n_experts
        fc_blocks = (hidden, hidden) if self.glu else (hidden,)
        self.c_fc = Experts(n_experts, dim, len(fc_blocks) * hidden, bias, fc_blocks, share)
        self.c_proj = Experts(n_experts, hidden, dim, bias, (dim,), share)
        self.c_proj.is_residual_proj = True  # GPT-2's 1/sqrt(2L) scaling, as for a dense FFN's output
        self.shared = kind(dim, n_shared * hidden, activation=activation, bias=bias) if n_shared else None
        self.shared_gate = nn.Linear(dim, 1, bias=False) if shared_gate else None
        self.register_buffer("expert_bias", torch.zeros(n_experts))  # loss-free balancing's b: in the checkpoint
        self._load: torch.Tensor | None = None  # assignments per expert since the last bias update (not a buffer:
        # DDP would overwrite each rank's with rank 0's at every forward)
        self.terms: list[Term] = []  # this forward's balancing losses, before their coefficients (lmlab.model.side)
        self.declared = {BALANCE: ("train",), ROUTER_Z: ("train",)}  # the terms it records, where they are logged
        self.figure_groups = ("moe",)  # the monitor's moe/<figure>/layer_XX (lmlab.run.monitor)
        self.stats: torch.Tensor | None = None  # this training forward's routing sums (STAT_TAIL), detached

    @staticmethod
    def sized_as(spec: Mapping[str, Any]) -> type:
        """The class whose parameter-matching rule sizes each expert (lmlab.model.resolve): the expert kind's."""
        return expert_kind(spec.get("expert", "mlp"))

    @staticmethod
    def n_params(dim: int, hidden: int, bias: bool, *, expert: str = "mlp", n_experts: int = 8, top_k: int = 2,
                 n_shared: int = 0, shared_gate: bool = False, active: bool = False, **routing: Any) -> int:
        """Router (E × dim), E experts (or the top_k a token uses, `active`), the shared FFN of n_shared·hidden and its
        gate (dim). The routing options (`routing`) hold no weights."""
        kind = expert_kind(expert)
        experts = (top_k if active else n_experts) * kind.n_params(dim, hidden, bias)
        shared = kind.n_params(dim, n_shared * hidden, bias) if n_shared else 0
        return dim * n_experts + experts + shared + dim * shared_gate

    def inactive_params(self) -> int:
        """The expert weights a token does not use: (E − k) experts' (what n_params minus active params is)."""
        per_expert = (self.c_fc.weight.numel() + self.c_proj.weight.numel()
                      + sum(b.numel() for b in (self.c_fc.bias, self.c_proj.bias) if b is not None)) // self.n_experts
        return (self.n_experts - self.top_k) * per_expert

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, d)
        N, E, k = flat.size(0), self.n_experts, self.top_k
        with torch.autocast(flat.device.type, enabled=False):  # the router in fp32 (ST-MoE: its softmax is sensitive)
            logits = F.linear(flat.float(), self.router.weight.float())  # (N, E)
        idx, w, p = route(logits, k, self.score, self.norm_topk, self.expert_bias)  # b = 0 chooses as s does

        chosen = idx.reshape(-1)  # (N·k,) the expert of each assignment, token-major
        counts = expert_counts(chosen, E)  # (E,) before any drop: the router's load
        order = torch.argsort(chosen, stable=True)  # assignments grouped by expert, token order kept in each group
        experts = chosen[order]  # (N·k,) sorted
        rank = torch.arange(order.numel(), device=order.device) - (counts.cumsum(0) - counts)[experts]  # in its group
        token = order // k  # (N·k,) the token of each assignment, grouped by expert
        weight = w.reshape(-1)[order] * self.routed_scale  # (N·k,)
        cap = capacity(N, k, E, self.capacity_factor) if self.training else None  # eval, generation: dropless
        slots = N if cap is None else min(cap, N)  # an expert's rows at most: a token reaches an expert once
        if cap is not None:  # the first `cap` assignments of each expert in token order stay; the others add nothing
            kept = rank < cap  # (a weight of 0, not a shorter batch: shapes stay static, nothing read to the host)
            weight, dropped = weight * kept, (~kept).sum()
        else:
            dropped = torch.zeros((), dtype=torch.long, device=flat.device)
        y = self._experts(flat[token], counts, experts, rank, slots)  # (N·k, d)
        out = torch.zeros(N, shape[-1], dtype=y.dtype, device=y.device).index_add(0, token, y * weight[:, None].to(
            y.dtype))
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared.to(out.dtype)

        if self.training:
            self._record(logits, p, counts, dropped)
        return out.reshape(shape).to(x.dtype)

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor, experts: torch.Tensor, rank: torch.Tensor,
                 slots: int) -> torch.Tensor:
        """xs (M, d) grouped by expert (`counts` rows each; `experts` (M,) their expert, `rank` their place among its
        rows) -> each row through its expert's FFN (M, d): two grouped matmuls, or two padded batched ones of `slots`
        rows per expert where F.grouped_mm does not run (lmlab.model.moe.padded_linear)."""
        device = xs.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else xs.dtype
        if _grouped_here(device, dtype):
            offs = counts.cumsum(0).to(torch.int32)
            matmul = functools.partial(grouped_linear, offs=offs)
        else:
            slot = torch.where(rank < slots, experts * slots + rank, self.n_experts * slots)
            matmul = functools.partial(padded_linear, slot=slot, slots=slots)
        w_fc, b_fc = self.c_fc.stack()
        w_proj, b_proj = self.c_proj.stack()
        with torch.autocast(device, enabled=False):
            h = matmul(xs.to(dtype), w_fc.to(dtype))  # (M, h) or (M, 2h)
            if b_fc is not None:
                h = h + b_fc.to(dtype)[experts]
            if self.glu:
                gate, up = h.chunk(2, dim=-1)
                h = self.act(gate) * up
            else:
                h = self.act(h)
            y = matmul(h, w_proj.to(dtype))  # (M, d)
            if b_proj is not None:
                y = y + b_proj.to(dtype)[experts]
        return y

    def _record(self, logits: torch.Tensor, p: torch.Tensor, counts: torch.Tensor, dropped: torch.Tensor) -> None:
        """The balancing losses of this forward (for the objective), the load for the bias update, the statistics."""
        N = logits.size(0)
        lse = torch.logsumexp(logits, dim=-1)  # (N,)
        self.terms = [Term(BALANCE, balance_loss(counts.float(), p.sum(0), N, self.top_k), self.balance_coef),
                      Term(ROUTER_Z, lse.square().mean(), self.z_coef)]
        load = counts.detach().float()
        self._load = load if self._load is None else self._load + load
        with torch.no_grad():
            entropy = -(p * p.clamp_min(1e-30).log()).sum()
            tokens = torch.full((), float(N), device=p.device)  # a fill, not a copy from the host (a GPU sync)
            tail = torch.stack([entropy, tokens, dropped.float(), lse.square().sum()])
            self.stats = torch.cat([load, p.sum(0), tail]).detach()

    @torch.no_grad()
    def update_bias(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """After an optimizer step: b ← b + u · sign(mean load − load) from the assignments since the last update
        (summed over ranks by `reduce`, so every rank moves b alike); then the count starts again."""
        load, self._load = self._load, None
        if load is None or not self.bias_update_rate:
            return
        if reduce is not None:
            load = reduce(load)
        self.expert_bias.copy_(bias_update(self.expert_bias, load.to(self.expert_bias.device), self.bias_update_rate))

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, top_k={self.top_k}, hidden={self.hidden}, score={self.score}, "
                f"norm_topk={self.norm_topk}, capacity_factor={self.capacity_factor}, routed_scale={self.routed_scale}")


def figures(stats: torch.Tensor, n_experts: int, top_k: int) -> dict[str, float]:
    """The monitor's figures of one layer from its routing sums (`MoE.stats`, summed over ranks: the global batch's):
    load max/mean and coefficient of variation (population std / mean) of the per-expert assignments, the mean router
    entropy (nats; ln E at a uniform router), the dropped share of the N·k assignments, the balance loss and the
    router z-loss (before their coefficients)."""
    E = n_experts
    counts, prob = stats[:E].double(), stats[E:2 * E].double()
    entropy, tokens, dropped, lse_sq = stats[2 * E:].double().tolist()
    mean = counts.mean()
    return {"load_max_over_mean": float(counts.max() / mean.clamp_min(1e-30)),
            "load_cv": float(counts.std(unbiased=False) / mean.clamp_min(1e-30)),
            "router_entropy": entropy / max(tokens, 1.0),
            "dropped": dropped / max(tokens * top_k, 1.0),
            "balance_loss": float(balance_loss(counts, prob, max(tokens, 1.0), top_k)),
            "router_z_loss": lse_sq / max(tokens, 1.0)}
