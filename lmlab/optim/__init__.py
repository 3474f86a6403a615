"""Optimizers and learning-rate schedules, one dict each.

Optimizer contract: `opt(param_groups, *, <own params>) -> torch.optim.Optimizer`; `param_groups` puts
weight decay only on matrices that are not embeddings (no decay on norms, biases, embeddings), the split
GPT-2/nanoGPT use. `grad_clip` in the `optim` config is read by the training loop, not the optimizer.
An option declares on itself what else it needs (`declare(option, ...)` with the fields of
`lmlab.optim.capabilities.OptimizerCaps`, read back with `capabilities(option)`): `roles = True` (its groups split by
role: `hidden` matrices, the `readout`, the rest; Muon), `mup = True` (an Adam-like, entrywise-normalised update, for
which µP's per-group learning rates are defined: `param=mup` takes only these), `shards` with a reason (refused under
trainer=fsdp2), `averages` with a reason (its evaluation weights are an average already: refused with a weight EMA,
optim.ema; lmlab.optim.ema), `check(params)` (a rule across its own keys, run before training), `layouts = True` (its
hidden groups carry each matrix's row blocks: Muon's split) and `mup_lr_mult(group, params, m)` (its own µP
learning-rate rule per group, None where µP's Adam rule applies: Muon's spectral one).
Schedule contract: `sched(step, max_steps, *, warmup_steps, <own params>) -> lr multiplier`; every schedule
warms up linearly over `warmup_steps` (0 = no warmup, the condition of the stability studies).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated, Literal

import torch
from torch import nn

from lmlab.optim.capabilities import Decays, capabilities, declare, marks
from lmlab.optim.cautious import CautiousAdamW
from lmlab.optim.lamb import LAMB
from lmlab.optim.muon import MuonAdamW
from lmlab.registry import (  # noqa: F401  (Betas: public here, as before)
    Betas,
    Fraction,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Range,
    check_values,
    gather,
    option_params,
)


def layout(module: nn.Module) -> tuple[tuple[int, int], ...] | None:
    """A Linear's row blocks (size, rows per head or 0) when it stores several matrices (`fused`: attention's q, k, v;
    a GLU's gate, up); the query and key blocks of an attention projection (`head_rows`, not `value_parts`) carry
    their head size. None: one matrix (or a stack of experts', `n_experts`, that is not fused)."""
    m = marks(module)
    blocks = m.fused
    if not blocks or len(blocks) < 2:
        return None
    head = m.head_rows
    values = m.value_parts if m.value_parts is not None else (True,) * len(blocks)
    per = len(values)  # an MoE's fused repeats one expert's blocks E times
    return tuple((size, 0 if values[i % per] else head) for i, size in enumerate(blocks))


def param_groups(model: nn.Module, weight_decay: float, by_role: bool = False,
                 layouts: bool = False) -> list[dict]:
    """Decay 2-D weights of Linear layers; never norms, biases or embedding tables (tied heads included).

    by_role: four groups, each with its `role`: `hidden` (the decayed matrices but the readout: every Linear weight
    inside the blocks), `readout` (a Linear marked `is_readout`, the untied LM head), `other` (decayed weights of
    more than one dimension that are no Linear's: the depthwise convolutions of canon layers and recurrent mixers,
    talking heads' (nh, nh) mixes, hyper-connections' and scaled residuals' coefficients; neither Muon's
    orthogonalisation, which made a (2, 1) pair of scalars a unit vector each step, nor µP's 1/width suits them:
    AdamW at the base lr) and `rest` (embeddings, gains, biases); empty groups are left out. The weights that stack E experts' matrices (a Linear with `n_experts` > 1, an
    MoE's) form `hidden` groups of their own after the first, one per E, with `experts` = E (Muon orthogonalises each
    expert's matrix). The default two groups are the optimizer state's layout of every earlier run.

    layouts (with by_role): each hidden group carries `layouts`, one per parameter, its row blocks (`layout`), which
    Muon's `split` cuts the matrix by. A model whose matrices take no decay (`decays` false: norm=ngpt's, renormalised
    after every step) has the same groups at weight decay 0."""
    if isinstance(model, Decays) and not model.decays:
        weight_decay = 0.0
    no_decay = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    readout = {id(m.weight) for m in model.modules() if marks(m).is_readout} - no_decay
    decay, rest = [], []
    for p in {id(p): p for p in model.parameters() if p.requires_grad}.values():
        (decay if p.dim() >= 2 and id(p) not in no_decay else rest).append(p)
    if not by_role:
        return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]
    stacked = {id(m.weight): m.n_experts for m in model.modules()
               if isinstance(m, nn.Linear) and marks(m).n_experts > 1}
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    groups = [{"params": [p for p in decay if id(p) in linear and id(p) not in readout and id(p) not in stacked],
               "weight_decay": weight_decay, "role": "hidden"},
              *({"params": [p for p in decay if stacked.get(id(p)) == E], "weight_decay": weight_decay,
                 "role": "hidden", "experts": E} for E in sorted(set(stacked.values()))),
              {"params": [p for p in decay if id(p) in readout], "weight_decay": weight_decay, "role": "readout"},
              {"params": [p for p in decay if id(p) not in linear], "weight_decay": weight_decay, "role": "other"},
              {"params": rest, "weight_decay": 0.0, "role": "rest"}]
    if layouts:
        of = {id(m.weight): layout(m) for m in model.modules() if isinstance(m, nn.Linear)}
        for g in groups:
            if g["role"] == "hidden":
                g["layouts"] = [of.get(id(p)) for p in g["params"]]
    return [g for g in groups if g["params"]]


def adamw(groups: Iterable[dict], *, lr: PositiveFloat = 1e-3, betas: Betas = (0.9, 0.95), eps: PositiveFloat = 1e-8,
          fused: bool | None = None, independent_wd: bool = False, cautious_wd: bool = False) -> torch.optim.Optimizer:
    """AdamW (Loshchilov & Hutter, 2019), decoupled weight decay.

    independent_wd=false is torch's AdamW: each step shrinks the decay group by lr_t·wd (lr_t = lr · schedule), so
    changing lr also changes the decay. independent_wd=true is the paper's own form, θ ← θ − s_t·wd·θ with s_t the
    schedule's multiplier only: the decay no longer depends on lr (so wd is per step, e.g. 1e-4, not 0.1). It runs as
    torch's AdamW with each group's weight_decay set to wd / lr, whose lr_t·wd/lr = s_t·wd (fused kernel kept).

    fused=None (auto) takes torch's fused kernel when every parameter is a float tensor on CPU or CUDA: the same
    update in one pass per tensor, ~3x faster than torch's default loop on CPU (measured: 17 vs 51 ms for 12M
    parameters, one thread); fused=false keeps torch's default implementation.

    cautious_wd=true decays an entry only where the update and the parameter agree in sign (lmlab.optim.cautious).
    """
    groups = list(groups)
    if independent_wd:  # torch multiplies by lr_t = lr·s_t: divide by the base lr once, leaving s_t·wd
        groups = [{**g, "weight_decay": g.get("weight_decay", 0.0) / lr} for g in groups]
    if fused is None:
        params = [p for g in groups for p in g["params"]]
        fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.is_floating_point() for p in params)
    if cautious_wd:
        groups = [{**g, "cautious": True} for g in groups]
    kind = CautiousAdamW if cautious_wd else torch.optim.AdamW
    return kind(groups, lr=lr, betas=tuple(betas), eps=eps, fused=fused or None)


declare(adamw, mup=True)


def sgd(groups: Iterable[dict], *, lr: PositiveFloat = 0.1, momentum: NonNegativeFloat = 0.9, nesterov: bool = False
        ) -> torch.optim.Optimizer:
    return torch.optim.SGD(groups, lr=lr, momentum=momentum, nesterov=nesterov)


def muon(groups: Iterable[dict], *, lr: PositiveFloat = 3e-3, adam_lr: PositiveFloat = 3e-3,
         momentum: Annotated[float, Range(ge=0, lt=1)] = 0.95, nesterov: bool = True, ns_steps: PositiveInt = 5,
         adjust_lr_fn: Literal["match_rms_adamw", "original"] = "match_rms_adamw", betas: Betas = (0.9, 0.95),
         eps: PositiveFloat = 1e-8, cautious_wd: bool = False, momentum_warmup_steps: NonNegativeInt = 0,
         momentum_start: Annotated[float, Range(ge=0, lt=1)] = 0.85, fused: bool | None = None,
         split: Literal["none", "parts", "heads", "head_pairs"] = "none",
         ns_coefficients: Literal["quintic", "polar_express"] = "quintic", normuon: bool = False,
         normuon_beta2: Annotated[float, Range(ge=0, lt=1)] = 0.95, normuon_eps: PositiveFloat = 1e-8,
         adam_every: PositiveInt = 1, momentum_cooldown_steps: NonNegativeInt = 0) -> MuonAdamW:
    """Muon for the hidden matrices at `lr` (scaled by `adjust_lr_fn`), AdamW (betas, eps) for the rest at `adam_lr`
    (lmlab.optim.muon); weight decay on the hidden matrices and an untied head, as for AdamW. The family's keys:
    `split` (fused matrices orthogonalised by part, head or pair of heads), `ns_coefficients` (quintic or Polar
    Express), `normuon` (NorMuon's per-neuron second moment, `normuon_beta2`, `normuon_eps`); `adam_every` (the AdamW
    half every k-th step, on the k steps' summed gradients: the speedrun's record 39), `momentum_cooldown_steps` (μ back
    to momentum_start over the run's last steps: record 39's cool-down)."""
    _check_muon({"ns_steps": ns_steps, "ns_coefficients": ns_coefficients})
    return MuonAdamW(groups, lr=lr, adam_lr=adam_lr, momentum=momentum, nesterov=nesterov, ns_steps=ns_steps,
                     adjust_lr_fn=adjust_lr_fn, betas=tuple(betas), eps=eps, cautious_wd=cautious_wd,
                     momentum_warmup_steps=momentum_warmup_steps, momentum_start=momentum_start, fused=fused,
                     adamw=adamw, split=split, ns_coefficients=ns_coefficients, normuon=normuon,
                     normuon_beta2=normuon_beta2, normuon_eps=normuon_eps, adam_every=adam_every,
                     momentum_cooldown_steps=momentum_cooldown_steps)


def _check_muon(params: dict) -> None:
    """Keys that fit only together: Polar Express's coefficients are five steps'."""
    if params.get("ns_coefficients") == "polar_express" and params.get("ns_steps", 5) != 5:
        raise ValueError(f"optim.ns_steps={params['ns_steps']} with optim.ns_coefficients=polar_express: its "
                         f"coefficients are computed for 5 steps; use optim.ns_steps=5")


def muon_mup_lr_mult(group: dict, params: dict, width_mult: float) -> float | None:
    """param=mup with Muon: a Muon group's lr multiplier from the spectral condition (lmlab.model.param): 1 under
    adjust_lr_fn=original, m^(-1/2) under match_rms_adamw; None (µP's Adam rule) for the AdamW groups."""
    if group.get("kind") not in ("muon", "muon_experts"):
        return None
    return 1.0 if params.get("adjust_lr_fn", "match_rms_adamw") == "original" else width_mult ** -0.5


declare(muon, roles=True,
        mup=True, mup_lr_mult=muon_mup_lr_mult,  # µP's init and multipliers, with the hidden lr its own
        check=_check_muon,  # run by validate_optim, before training
        layouts=True)  # its hidden groups carry each matrix's row blocks (optim.split)


def lamb(groups: Iterable[dict], *, lr: PositiveFloat = 1e-2, betas: Betas = (0.9, 0.999), eps: PositiveFloat = 1e-6,
         max_trust_norm: PositiveFloat | None = None) -> LAMB:
    """LAMB (lmlab.optim.lamb): Adam's direction plus decay, rescaled per tensor by the trust ratio ‖θ‖/‖r‖."""
    return LAMB(groups, lr=lr, betas=betas, eps=eps, max_trust_norm=max_trust_norm)


# the decay is inside the trust ratio: a zero-gradient step gives θ·(1 − lr), not θ·(1 − lr·wd)
declare(lamb, trust_ratio=True)


def schedulefree(groups: Iterable[dict], *, lr: PositiveFloat = 3e-3, betas: Betas = (0.9, 0.95),
                 eps: PositiveFloat = 1e-8, r: NonNegativeFloat = 0.0, weight_lr_power: NonNegativeFloat = 2.0,
                 foreach: bool | None = None) -> torch.optim.Optimizer:
    """Schedule-free AdamW (lmlab.optim.schedule_free), returned in train mode; `r` and `weight_lr_power` weigh the
    average (polynomial in the step, and lr_max^power during warm-up)."""
    from lmlab.optim.schedule_free import ScheduleFreeAdamW

    groups = list(groups)
    if foreach is None:
        foreach = all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
    opt = ScheduleFreeAdamW(groups, lr=lr, betas=tuple(betas), eps=eps, warmup_steps=0, r=r,
                            weight_lr_power=weight_lr_power, foreach=foreach)
    opt.train()
    return opt


declare(schedulefree, mup=True,
        averages=("its evaluation weights x are already an average of the iterates (what validation, eval.py and the "
                  "checkpoint read); set optim.ema=0"),
        shards=("its checkpoints hold the evaluation weights x computed from the whole state dict, which "
                "trainer=fsdp2 writes sharded; use trainer=ddp"))


def adafactor(groups: Iterable[dict], *, lr: PositiveFloat = 1e-2, beta2_decay: Annotated[float, Range(lt=0)] = -0.8,
              d: PositiveFloat = 1.0) -> torch.optim.Optimizer:
    """Adafactor (Shazeer & Stern, 2018), torch's: a matrix's second moment kept as row and column means (rows +
    cols numbers instead of rows·cols), no first moment; the memory-lean choice. Steps are relative to each tensor's
    RMS, min(lr, 1/√t)·max(1e-3, RMS(θ)); weight decay is θ·(1 − lr·wd); d clips the update's RMS."""
    return torch.optim.Adafactor(groups, lr=lr, beta2_decay=beta2_decay, d=d)


def _warmup(step: int, warmup_steps: int) -> float | None:
    return (step + 1) / warmup_steps if step < warmup_steps else None


def constant(step: int, max_steps: int, *, warmup_steps: NonNegativeInt = 0) -> float:
    return _warmup(step, warmup_steps) or 1.0


def cosine(step: int, max_steps: int, *, warmup_steps: NonNegativeInt = 0, min_lr_ratio: Fraction = 0.1) -> float:
    """Linear warmup, then a half cosine from 1 down to min_lr_ratio at max_steps."""
    if (w := _warmup(step, warmup_steps)) is not None:
        return w
    t = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def linear(step: int, max_steps: int, *, warmup_steps: NonNegativeInt = 0, min_lr_ratio: Fraction = 0.0) -> float:
    """Linear warmup, then linear decay to min_lr_ratio at max_steps."""
    if (w := _warmup(step, warmup_steps)) is not None:
        return w
    t = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return 1 - (1 - min_lr_ratio) * t


def wsd(step: int, max_steps: int, *, warmup_steps: NonNegativeInt = 0, decay_frac: Fraction = 0.2,
        min_lr_ratio: Fraction = 0.0) -> float:
    """Warmup-stable-decay (Hu et al., 2024, MiniCPM): constant after warmup, then a linear cool-down over the
    last `decay_frac` of training."""
    if (w := _warmup(step, warmup_steps)) is not None:
        return w
    decay_start = max_steps - int(decay_frac * max_steps)
    if step < decay_start:
        return 1.0
    t = min(1.0, (step - decay_start) / max(1, max_steps - decay_start))
    return 1 - (1 - min_lr_ratio) * t


def inverse_sqrt(step: int, max_steps: int, *, warmup_steps: NonNegativeInt = 0) -> float:
    """Vaswani et al. (2017) exactly, normalised to 1 at its peak: min(n/W, √(W/n)) with n = step + 1 the 1-based
    step number the paper counts (lmlab's step is 0-based): linear warmup to 1 at n = W, then √(W/n) — √(W/(W+1)) one
    step after the peak, ½ at n = 4W — and no end point (it keeps falling past max_steps). With warmup 0 it is
    1/√n: the full rate at the first step."""
    if (w := _warmup(step, warmup_steps)) is not None:
        return w
    return math.sqrt(max(warmup_steps, 1) / (step + 1))


OPTIMIZERS = {"adamw": adamw, "sgd": sgd, "adafactor": adafactor, "muon": muon, "lamb": lamb,
              "schedulefree": schedulefree}

# an optimizer in a file of its own in this folder registers itself: its module's OPTION, under the file's name
# (`optim=adan` is adan.py's)
for _name, _option in gather(__name__, __path__, "OPTION").items():
    OPTIMIZERS.setdefault(_name, _option)
SCHEDULES = {"cosine": cosine, "linear": linear, "constant": constant, "wsd": wsd, "inverse_sqrt": inverse_sqrt}


# --- the optim and schedule groups, checked (lmlab.run.checks: before Lightning is imported) ----------------------

# the loop's keys: z_loss is PaLM's auxiliary λ·mean(log Z)² on the output logits (0: off), added to the objective;
# ema the decay of a weight EMA evaluated beside the weights (0: off), ema_start the steps it copies them first
# (lmlab.optim.ema); qk_clip the max attention logit τ QK-clip keeps every head under (null: off; lmlab.optim.qk_clip)
OPTIM_LOOP_KEYS = {"weight_decay": NonNegativeFloat, "grad_clip": NonNegativeFloat | None, "z_loss": NonNegativeFloat,
                   "ema": Annotated[float, Range(ge=0, lt=1)], "ema_start": NonNegativeInt,
                   "qk_clip": PositiveFloat | None, "groups": list | None}  # groups: lmlab.optim.overrides


def optimizer_spec(optim: dict) -> dict:
    """The optim group less the training loop's keys: what the optimizer option is built from."""
    return {k: v for k, v in optim.items() if k not in OPTIM_LOOP_KEYS}


def check_pieces(optim: dict, model: nn.Module) -> None:
    """An optimizer that cuts matrices by their row blocks (Muon's optim.split) cut against `model` (on the meta
    device: only shapes are read), only for such an optimizer: a split that does not fit a matrix is
    refused, naming the key, before training."""
    from lmlab.optim.muon import pieces

    name, params = option_params("optim", OPTIMIZERS, optimizer_spec(optim))
    if not capabilities(OPTIMIZERS[name]).layouts or params.get("split", "none") == "none":
        return
    for g in param_groups(model, 0.0, by_role=True, layouts=True):
        for p, lay in zip(g["params"], g.get("layouts", []), strict=False):
            pieces(p.size(0), lay, g.get("experts", 1), params.get("split", "none"))


def validate_optim(optim: dict, schedule: dict, strategy: str | None = None, param: dict | None = None) -> None:
    """Names, keys, types and ranges of the optim and schedule groups (the ranges are on each option's signature);
    an option that cannot run on sharded parameters (its `shards` reason) is refused under FSDP2 (`strategy`, the
    trainer strategy's class name), and so is a weight EMA (optim.ema > 0), which an option whose evaluation weights
    are an average already (its `averages` reason) refuses too; a parametrisation with per-role learning rates (µP)
    takes the optimizers whose update is Adam-like (`mup` on the option)."""
    check_values("optim.", optim, OPTIM_LOOP_KEYS)
    name, params = option_params("optim", OPTIMIZERS, optimizer_spec(optim))
    caps = capabilities(OPTIMIZERS[name])
    if caps.check is not None:  # an option's own rule across its keys
        caps.check(params)
    option_params("schedule", SCHEDULES, schedule)
    reason = caps.shards
    if reason and strategy == "FSDP2Strategy":
        raise ValueError(f"optim={name} with trainer=fsdp2: {reason}")
    if ema := optim.get("ema"):
        if reason := caps.averages:
            raise ValueError(f"optim.ema={ema} with optim={name}: {reason}")
        if strategy in ("FSDP2Strategy", "fsdp"):  # trainer=fsdp2, trainer=fsdp (Lightning's FSDP)
            raise ValueError(f"optim.ema={ema} with trainer={'fsdp2' if strategy == 'FSDP2Strategy' else 'fsdp'}: the "
                             f"EMA is averaged and checkpointed as whole tensors beside the weights, which FSDP "
                             f"shards; use trainer=ddp, or optim.ema=0")
    if param is not None and param.get("name", "sp") != "sp" and not caps.mup:
        takes = sorted(k for k, fn in OPTIMIZERS.items() if capabilities(fn).mup)
        raise ValueError(f"param={param['name']} with optim={name}: µP's learning rates (hidden lr·base_width/d_model) "
                         f"are those of Adam-like, entrywise-normalised updates; choose optim among {takes}")
