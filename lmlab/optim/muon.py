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

The Muon family, each a key of optim=muon (all off: torch.optim.Muon's step, as every earlier run):

- `split` — which matrices are orthogonalised apart. A fused projection is several matrices stored as row blocks
  (a Linear's `fused`: attention's [W_q; W_k; W_v], a GLU's [W_gate; W_up], GAU's [W_u; W_v; W_z]); `none`
  orthogonalises the stack as one matrix, `parts` each block on its own (modded-nanogpt's Q, K, V apart), `heads`
  the query and key blocks one head at a time (a Linear's `head_rows`; values and the rest by part) and
  `head_pairs` in pairs of adjacent heads (modded-nanogpt's qk bank). Every piece (m_i × n) takes its own
  s(m_i, n). An MoE's stacked experts are always apart (one expert's blocks at least).
- `ns_coefficients` — `quintic` (a, b, c) = (3.4445, −4.775, 2.0315) at every step from X = U/‖U‖_F, or
  `polar_express` (Amsel, Persson, Musco & Gower, 2025): a different odd quintic p_t(x) = a_t x + b_t x³ + c_t x⁵ at
  each of the 5 steps (minimax-optimal for σ ∈ [10⁻³, 1], safety factor 2·10⁻², cushion 2; the numbers
  modded-nanogpt runs), from X = U/(1.02·‖U‖_F + 10⁻⁶). Its composition takes singular values from 10⁻³ to 1 much
  closer to 1 than the quintic's 5 steps (tests/unit/optim/test_muon_family.py measures both).
- `normuon` (Li et al., 2025, NorMuon): a second moment per neuron (row) of the orthogonalised update,
  v ← β₂·v + (1 − β₂)·mean_j O_ij², Ô = O / (√v + ε), then Ô rescaled to the Frobenius norm of an orthogonal
  piece, √min(m, n) (so that with `match_rms_adamw` the step is the paper's lr·0.2·√(mn)·Ô/‖Ô‖_F; `normuon_beta2`).

Momentum warm-up (modded-nanogpt): μ rises linearly from `momentum_start` to `momentum` over `momentum_warmup_steps`,
and with `momentum_cooldown_steps` falls back linearly to `momentum_start` over the run's last steps (record 39's
cool-down: μ = momentum − (s − (N − c))/c·(momentum − momentum_start) for s > N − c, N the run's max_steps, which the
training loop hands over: `set_max_steps`).
`adam_every=k` steps the AdamW half every k-th step only, on the sum of the k steps' gradients (the speedrun's record
39, k = 2: Muon every step, the Adam tensors every other); the gradients between its steps wait in the optimizer's
state (`grad_sum`), so a checkpoint taken between two Adam steps resumes exactly.
Under FSDP2 each rank holds row shards of W (DTensors), and NS needs the whole matrix: PieceMuon keeps the momentum
sharded (it is elementwise), gathers the update (one all-gather per matrix), orthogonalises the whole matrix on every
rank alike (deterministic, so the ranks agree without a broadcast) and applies its own rows of the step; the same
numbers as one process to float rounding (tests/e2e/optim/test_muon.py), at the cost of every rank computing every
matrix's NS (torchtitan's and Dion's distributed NS split that work; lmlab's scale does not need it). DDP needs
nothing: each rank holds the whole matrices and the all-reduced gradients, and takes the same step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from lmlab.optim.cautious import cautious_step

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
# Polar Express's five steps (Amsel et al., 2025; computed for 5 iterations, safety factor 2e-2, cushion 2), and the
# normalisation they are computed for: X = U / (‖U‖_F·(1 + 2e-2) + 1e-6)
POLAR_EXPRESS = ((8.156554524902461, -22.48329292557795, 15.878769915207462),
                 (4.042929935166739, -2.808917465908714, 0.5000178451051316),
                 (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
                 (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
                 (2.3465413258596377, -1.7097828382687081, 0.42323551169305323))
POLAR_SAFETY, POLAR_EPS = 2e-2, 1e-6
SPLITS = ("none", "parts", "heads", "head_pairs")


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


def polar_express(g: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Polar Express's five steps X ← a_t X + (b_t A + c_t A²) X, A = XXᵀ, from X = G/(1.02·‖G‖_F + 10⁻⁶) (a tall G
    transposed), on a matrix or an (E, m, n) stack; in bf16 as Muon runs (`dtype`: float64 for the tests)."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) * (1 + POLAR_SAFETY) + POLAR_EPS)
    mm = torch.addmm if x.dim() == 2 else torch.baddbmm
    for a, b, c in POLAR_EXPRESS:
        A = x @ x.mT
        x = mm(x, mm(A, A, A, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


def pieces(rows: int, layout: tuple[tuple[int, int], ...] | None, experts: int, split: str) -> list[int]:
    """The row counts of the matrices a weight of `rows` rows is orthogonalised as, top to bottom. `layout`: its row
    blocks (size, rows per head of a query/key block or 0), from lmlab.optim.param_groups; an MoE's stack of
    `experts` is never one matrix."""
    blocks = list(layout or ()) or [(rows // experts, 0)] * experts
    if split == "none" or not layout:
        return [rows // experts] * experts
    if split == "parts":
        return [size for size, _ in blocks]
    out = []
    for size, head in blocks:
        step = head * (2 if split == "head_pairs" else 1)
        if not head:
            out.append(size)
        elif size % step:
            raise ValueError(f"optim.split={split}: a query/key block of {size // head} heads cannot be cut in pairs "
                             f"of heads (model.n_head and model.n_kv_head must be even); use optim.split=heads or "
                             f"parts")
        else:
            out += [step] * (size // step)
    return out


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


class PieceMuon(torch.optim.Optimizer):
    """Muon one piece at a time (`pieces`: the split), with the family's keys: momentum on the whole tensor as torch's
    step has it, then per piece the orthogonalisation (`ns_coefficients`), NorMuon's per-row normalisation and the lr
    scale s(m_i, n). A group's `layouts` (one per parameter: its row blocks) come from param_groups; `experts` > 1
    stacks. With split=none, quintic, normuon=false it is torch.optim.Muon's update (ExpertMuon's, for a stack)."""

    def __init__(self, params: Iterable, lr: float, momentum: float, nesterov: bool, ns_steps: int,
                 adjust_lr_fn: str | None, weight_decay: float = 0.1, split: str = "none",
                 ns_coefficients: str = "quintic", normuon: bool = False, normuon_beta2: float = 0.95,
                 normuon_eps: float = 1e-8) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                      adjust_lr_fn=adjust_lr_fn, weight_decay=weight_decay, eps=1e-7, split=split,
                                      ns_coefficients=ns_coefficients, normuon=normuon, normuon_beta2=normuon_beta2,
                                      normuon_eps=normuon_eps))
        for g in self.param_groups:  # every piece list known, and checked, before the first step
            layouts = g.get("layouts") or [None] * len(g["params"])
            g["pieces"] = [pieces(p.size(0), lay, g.get("experts", 1), g["split"]) for p, lay in
                           zip(g["params"], layouts, strict=True)]
            g.pop("layouts", None)

    def orthogonalise(self, g: dict, u: torch.Tensor) -> torch.Tensor:
        """O of a stack of equal pieces (k, m, n)."""
        if g["ns_coefficients"] == "polar_express":
            return polar_express(u)
        return newton_schulz(u, g["ns_steps"], NS_COEFFICIENTS, g["eps"])

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for g in self.param_groups:
            mu = g["momentum"]
            for p, rows in zip(g["params"], g["pieces"], strict=True):
                if p.grad is None:
                    continue
                state = self.state[p]
                buf = state.setdefault("momentum_buffer", torch.zeros_like(p.grad))
                buf.lerp_(p.grad, 1 - mu)
                update = p.grad.lerp(buf, mu) if g["nesterov"] else buf
                sharded = isinstance(p, DTensor)  # FSDP2's row shard: the whole matrix gathered, every rank alike
                full = update.full_tensor() if sharded else update
                n = p.size(1)
                out, start = [], 0
                for size, count in _runs(rows):  # equal neighbours in one batched iteration
                    stack = full[start:start + size * count].view(count, size, n)
                    out.append(self.orthogonalise(g, stack).reshape(size * count, n))
                    start += size * count
                o = torch.cat(out).to(p.dtype)
                if g["normuon"]:
                    o = self.normalise(g, state, o, rows)
                p.mul_(1 - g["lr"] * g["weight_decay"])
                if sharded:  # the step of the whole matrix, scaled piece by piece, then this rank's rows of it
                    scale = torch.cat([torch.full((size, 1), g["lr"] * lr_scale(g["adjust_lr_fn"], size, n),
                                                  dtype=o.dtype, device=o.device) for size in rows])
                    p.sub_(distribute_tensor(o * scale, p.device_mesh, p.placements, src_data_rank=None))
                    continue
                start = 0
                for size in rows:
                    p[start:start + size].add_(o[start:start + size], alpha=-g["lr"] * lr_scale(g["adjust_lr_fn"],
                                                                                               size, n))
                    start += size
        return loss

    @staticmethod
    def normalise(g: dict, state: dict, o: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """NorMuon: each row by the root of its second moment, then each piece back to an orthogonal matrix's
        Frobenius norm √min(m_i, n)."""
        v = state.setdefault("normuon_v", torch.zeros(o.size(0), 1, dtype=torch.float32, device=o.device))
        v.lerp_(o.float().square().mean(dim=1, keepdim=True), 1 - g["normuon_beta2"])
        o_hat = o.float() / (v.sqrt() + g["normuon_eps"])
        start, n = 0, o.size(1)
        for size in rows:
            piece = o_hat[start:start + size]
            piece.mul_(math.sqrt(min(size, n)) / piece.norm().clamp(min=1e-12))
            start += size
        return o_hat.to(o.dtype)


def _named(value: object) -> object:
    """A group's family value by its key's name (torch's Muon keeps the quintic's (a, b, c) as ns_coefficients)."""
    return "quintic" if isinstance(value, tuple | list) and tuple(value) == NS_COEFFICIENTS else value


def _yaml(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _runs(rows: list[int]) -> list[tuple[int, int]]:
    """(size, how many in a row) of a piece list: [64, 16, 16] → [(64, 1), (16, 2)]."""
    out: list[list[int]] = []
    for r in rows:
        if out and out[-1][0] == r:
            out[-1][1] += 1
        else:
            out.append([r, 1])
    return [(r, c) for r, c in out]


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two kinds of groups (`kind`: "muon" or "adamw"); each kind is stepped by torch's own
    optimizer, which shares this object's param groups and state, so `state_dict()`/`load_state_dict()` are torch's:
    one state per parameter, every group's hyper-parameters (and the momentum warm-up's step count) in its dict."""

    def __init__(self, groups: Iterable[dict], *, lr: float, adam_lr: float, momentum: float, nesterov: bool,
                 ns_steps: int, adjust_lr_fn: str, betas: tuple[float, float], eps: float, cautious_wd: bool,
                 momentum_warmup_steps: int, momentum_start: float, fused: bool | None = None,
                 adamw: Callable[..., torch.optim.Optimizer] = torch.optim.AdamW, split: str = "none",
                 ns_coefficients: str = "quintic", normuon: bool = False, normuon_beta2: float = 0.95,
                 normuon_eps: float = 1e-8, adam_every: int = 1, momentum_cooldown_steps: int = 0) -> None:
        """`adamw(groups, lr=, betas=, eps=, fused=)` builds the AdamW half (lmlab.optim passes its own: the fused
        kernel picked, cautious decay honoured). The family's keys (split, ns_coefficients, normuon) at their
        defaults leave the hidden matrices to torch.optim.Muon (and an MoE's to ExpertMuon); set, to PieceMuon."""
        family = dict(split=split, ns_coefficients=ns_coefficients, normuon=normuon, normuon_beta2=normuon_beta2,
                      normuon_eps=normuon_eps)
        groups = list(groups)
        sharded = any(isinstance(p, DTensor) for g in groups for p in g["params"])  # FSDP2: torch's Muon refuses
        plain = split == "none" and ns_coefficients == "quintic" and not normuon and not sharded
        muon_groups, expert_groups, adam_groups = [], [], []
        for g in groups:
            params = list(g["params"])
            if not params:
                continue
            role = g.get("role", "hidden" if all(p.dim() == 2 for p in params) else "other")
            kind = adam_groups if role != "hidden" else expert_groups if g.get("experts", 1) > 1 else muon_groups
            kind.append({**g, "params": params, "cautious": cautious_wd})
            if plain or kind is adam_groups:
                kind[-1].pop("layouts", None)
        children = []
        for kind, builder, kind_groups in (("muon", torch.optim.Muon, muon_groups),
                                           ("muon_experts", ExpertMuon, expert_groups)):
            if not kind_groups:
                continue
            if plain:
                child = builder(kind_groups, lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                adjust_lr_fn=adjust_lr_fn)
            else:
                child = PieceMuon(kind_groups, lr=lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                                  adjust_lr_fn=adjust_lr_fn, **family)
            children.append(child)
            for g in children[-1].param_groups:
                g.update(kind=kind, momentum_target=momentum, momentum_start=momentum_start,
                         momentum_warmup_steps=momentum_warmup_steps, muon_step=0)
                if momentum_cooldown_steps:  # only then: other runs keep their groups' keys
                    g.update(momentum_cooldown_steps=momentum_cooldown_steps, max_steps=None)
        if adam_groups:
            children.append(adamw(adam_groups, lr=adam_lr, betas=betas, eps=eps, fused=fused))
            for g in children[-1].param_groups:
                g["kind"] = "adamw"
                if adam_every > 1:  # only then: other runs keep their groups' keys
                    g.update(adam_every=adam_every, adam_calls=0)
        self._children = {g["kind"]: child for child in children for g in child.param_groups}
        super().__init__([g for child in children for g in child.param_groups], {})
        self._link()

    def _link(self) -> None:
        """Let each kind's optimizer see this object's groups and state (again after load_state_dict replaced them)."""
        for kind, child in self._children.items():
            child.param_groups = [g for g in self.param_groups if g["kind"] == kind]
            child.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, after a check that the checkpoint's Muon steps are this optimizer's: a checkpoint from before the
        family's keys (its groups have no `split`) was stepped as split=none, quintic, no NorMuon, and resuming it
        with another split (optim.split=heads, the YAML's default since) would change the run half-way."""
        family = (("split", "none"), ("ns_coefficients", "quintic"), ("normuon", False))
        pairs = list(zip(self.param_groups, state_dict.get("param_groups", []), strict=False))
        for now, saved in pairs:
            if now["kind"] not in MUON_KINDS:
                continue
            changed = {k: (_named(saved.get(k, d)), _named(now.get(k, d))) for k, d in family
                       if _named(saved.get(k, d)) != _named(now.get(k, d))}
            if changed:
                was = " ".join(f"optim.{k}={_yaml(a)}" for k, (a, _) in changed.items())
                is_ = " ".join(f"optim.{k}={_yaml(b)}" for k, (_, b) in changed.items())
                raise ValueError(f"the checkpoint's Muon was stepped with {was} ({is_} now): resume it with {was}, "
                                 f"or start over")
        kept = [dict(g) for g in self.param_groups]
        super().load_state_dict(state_dict)
        for g, before in zip(self.param_groups, kept, strict=True):  # keys a checkpoint's groups lack: kept
            for k, v in before.items():
                g.setdefault(k, v)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        loss = torch.enable_grad()(closure)() if closure is not None else None
        for g in self.param_groups:
            if g["kind"] in MUON_KINDS:  # the momentum warm-up: μ_t from momentum_start to momentum over the steps
                w, c, s = g["momentum_warmup_steps"], g.get("momentum_cooldown_steps", 0), g["muon_step"]
                frac = min(1.0, s / w) if w else 1.0
                if c and g["max_steps"] is not None and s > g["max_steps"] - c:  # the cool-down: back toward start
                    frac = 1.0 - (s - (g["max_steps"] - c)) / c
                g["momentum"] = g["momentum_start"] + frac * (g["momentum_target"] - g["momentum_start"])
                g["muon_step"] += 1
        adam_now = self._hold_adam_grads()
        cautious_step(self, lambda: [child.step() for kind, child in self._children.items()
                                     if kind != "adamw" or adam_now])
        return loss

    def set_max_steps(self, max_steps: int) -> None:
        """The run's length, which the momentum cool-down counts back from (called by the training loop)."""
        for g in self.param_groups:
            if "momentum_cooldown_steps" in g:
                g["max_steps"] = int(max_steps)

    def _hold_adam_grads(self) -> bool:
        """optim.adam_every=k: whether the AdamW half steps now (every k-th call); between its steps each gradient is
        added to the state's `grad_sum` and taken off the parameter, and on its step the sum is put back."""
        groups = [g for g in self.param_groups if g["kind"] == "adamw" and g.get("adam_every", 1) > 1]
        if not groups:
            return True
        now = False
        for g in groups:
            g["adam_calls"] += 1
            now = g["adam_calls"] % g["adam_every"] == 0
            for p in g["params"]:
                state = self.state[p]
                if p.grad is not None and not now:
                    state["grad_sum"] = p.grad.clone() if "grad_sum" not in state else state["grad_sum"] + p.grad
                    p.grad = None
                elif now and "grad_sum" in state:
                    held = state.pop("grad_sum")  # before AdamW reads its state (an empty one is initialised)
                    p.grad = held if p.grad is None else p.grad + held
        return now
