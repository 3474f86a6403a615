"""Compute-matched comparisons: `budget.flops=`, `budget.tokens=`, `budget.tokens_per_param=` or `budget.wall=` in
place of `trainer.max_steps`.

At equal steps a variant with more FLOPs per token gets more compute and wins for it; at an equal budget each
variant of a sweep trains for its own number of steps, and the schedule (warmup, decay) is stretched to that length
because every schedule reads `trainer.max_steps`, which the budget sets in the run's effective config
(lmlab.run.plan). The rules, with T the tokens of one optimizer step (batch_size × max_seq_len ×
accumulate_grad_batches × devices × num_nodes) and F the model's train FLOPs per token
(lmlab.model.flops.flops_per_token: 6·N plus the attention scores at the real window, active parameters for a sparse
FFN):

    flops:            steps = floor(budget / (F · T))
    tokens:           steps = floor(budget / T)
    tokens_per_param: steps = floor(budget · N / T)     N = matmul weights (the 6·N count's N; Chinchilla ≈ 20)
    wall:             Lightning's max_time = budget seconds (whole); the steps are fitted as the run goes

Under a batch or length schedule (data.batch_schedule, data.seq_schedule: lmlab.data.stages) a step's tokens and
FLOPs per token follow its stage, and the stages scale with trainer.max_steps: the steps are the most S whose S steps,
staged over S, stay within the budget (`staged_steps`), and `summary.json` keeps the stages (`stage_table`) for the
FLOPs and tokens spent and compare's figures to a target.

A wall budget cannot know the steps before training: lmlab.run.wall.WallHorizon times the run's own steps and fits the
horizon every schedule reads to the step the seconds reach, again and again as the run goes, so the decay ends at the
budget (`python train.py budget.wall=300` installs it; library use passes `callbacks=[WallHorizon()]` to train()). The
summary records the budget, the steps it gave and what was spent (budget_spent: tokens, FLOPs, seconds).
"""

from __future__ import annotations

import math
from typing import Any

from omegaconf import DictConfig, OmegaConf

KINDS = ("flops", "tokens", "tokens_per_param", "wall")


def chosen(cfg: DictConfig) -> tuple[str, float] | None:
    """The budget set (kind, value), None for none; refuses two at once, non-numbers and values ≤ 0 by key."""
    budget = OmegaConf.to_container(cfg.get("budget") or {}, resolve=True)
    if unknown := sorted(set(budget) - set(KINDS)):
        raise ValueError(f"budget.{unknown[0]} is not a budget; choose one of {[f'budget.{k}' for k in KINDS]}")
    set_ = {k: v for k, v in budget.items() if v is not None}
    if len(set_) > 1:
        both = " and ".join(f"budget.{k}={v:g}" if isinstance(v, (int, float)) else f"budget.{k}={v!r}"
                            for k, v in set_.items())
        raise ValueError(f"{both} are set together; set one budget (or none: trainer.max_steps decides)")
    if not set_:
        return None
    (kind, value), = set_.items()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"budget.{kind}={value!r} must be a number > 0 (or null)")
    return kind, float(value)


def equal_flops_width(n_layer: int, ref_layers: int, ref_width: int, multiple: int = 8) -> int:
    """The width at which `n_layer` layers hold the matmul weights (12·L·d², so about the FLOPs per token) of
    `ref_layers` layers of `ref_width`: d = ref_width·√(ref_layers / n_layer), rounded to `multiple` (a head-count
    multiple). The resolver `${lmlab.equal_flops_width:${model.n_layer},4,128}` of experiment=depth_width."""
    return max(multiple, round(ref_width * math.sqrt(ref_layers / n_layer) / multiple) * multiple)


def world_size(cfg: DictConfig) -> int:
    """Processes that each train a batch per step: trainer.devices × trainer.num_nodes (devices=auto: the GPUs, or
    1 on a CPU)."""
    devices = cfg.trainer.get("devices", 1)
    if not isinstance(devices, int) or isinstance(devices, bool):
        import torch

        devices = max(1, torch.cuda.device_count()) if str(devices) in ("auto", "-1") else len(list(devices))
    return devices * int(cfg.trainer.get("num_nodes", 1) or 1)


def tokens_per_step(cfg: DictConfig) -> int:
    return (int(cfg.data.batch_size) * int(cfg.model.max_seq_len) * int(cfg.trainer.get("accumulate_grad_batches", 1))
            * world_size(cfg))


def stages_of(cfg: DictConfig) -> dict[str, Any] | None:
    """The run's batch and length schedules as the loop reads them ({batch, seq, batch_lr_power}), checked; None
    without either."""
    from lmlab.data import stages

    data, seq_len = cfg.data, int(cfg.model.max_seq_len)
    batch = stages.check("data.batch_schedule", OmegaConf.to_container(data.get("batch_schedule"))
                         if data.get("batch_schedule") is not None else None)
    seq = stages.check("data.seq_schedule", OmegaConf.to_container(data.get("seq_schedule"))
                       if data.get("seq_schedule") is not None else None, limit=seq_len, divides=seq_len)
    if batch is None and seq is None:
        return None
    return {"batch": batch, "seq": seq, "batch_lr_power": float(data.get("batch_lr_power") or 0.0)}


def stage_table(cfg: DictConfig, model, max_steps: int | None = None) -> list[dict[str, Any]]:
    """lmlab.data.stages.table for the run `cfg` and its model (its FLOPs per token at each stage's length)."""
    from lmlab.data import stages
    from lmlab.model.flops import flops_per_token

    staged = stages_of(cfg) or {}
    per_batch = tokens_per_step(cfg) // (int(cfg.data.batch_size) * int(cfg.model.max_seq_len))  # ranks × accumulation
    return stages.table(int(max_steps or cfg.trainer.max_steps), staged.get("batch"), staged.get("seq"),
                        batch_size=int(cfg.data.batch_size), seq_len=int(cfg.model.max_seq_len), per_batch=per_batch,
                        flops_per_token=lambda s: flops_per_token(model, s)["train"])


def staged_steps(kind: str, value: float, cfg: DictConfig, model, n_matmul: int) -> int:
    """The optimizer steps a budget buys under a schedule: the most S whose S steps, with the stages placed over S,
    cost at most `value` (the cost grows with S; found by bisection). Refuses a budget below one step."""
    from lmlab.record.targets import through

    def cost(steps: int) -> float:
        tokens, flops = through(stage_table(cfg, model, steps), steps)
        return {"flops": flops, "tokens": tokens, "tokens_per_param": tokens / n_matmul}[kind]

    if cost(1) > value * (1 + 1e-12):
        raise ValueError(f"budget.{kind}={value:g} buys no optimizer step: the first step costs {cost(1):g} under "
                         f"data.batch_schedule / data.seq_schedule")
    lo, hi = 1, 2
    while cost(hi) <= value * (1 + 1e-12):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if cost(mid) <= value * (1 + 1e-12) else (lo, mid)
    return lo


def steps_for(kind: str, value: float, *, flops_per_token: float, tokens_per_step: int, n_matmul: int) -> int:
    """The optimizer steps a budget buys (the rules of the module docstring); refuses a budget below one step."""
    per_step = {"flops": flops_per_token * tokens_per_step, "tokens": tokens_per_step,
                "tokens_per_param": tokens_per_step / n_matmul}[kind]
    steps = math.floor(value / per_step * (1 + 1e-12))  # 1e15 / 1e15 is one step, not 0.999...
    if steps < 1:
        raise ValueError(f"budget.{kind}={value:g} buys no optimizer step: one step costs {per_step:g} "
                         f"({tokens_per_step} tokens at {flops_per_token:g} FLOPs/token, {n_matmul} matmul weights)")
    return steps


def apply(cfg: DictConfig, model_cfg, meta=None) -> dict[str, Any] | None:
    """Set the effective config's trainer.max_steps (or max_time) from its budget, for the model `model_cfg` (a
    validated GPTConfig; `meta`: its model on the meta device, when the start has built it, else built here when a
    budget needs its FLOPs). Returns what summary.json records as `budget` (None without one). Writes into `cfg`: the
    plan's own copy."""
    budget = chosen(cfg)
    if budget is None:
        return None
    kind, value = budget
    if kind == "wall":
        OmegaConf.update(cfg, "trainer.max_time", max_time(value), force_add=True)
        return {"kind": kind, "value": value, "steps": None}
    import torch

    from lmlab.model.flops import flops_per_token, matmul_params
    from lmlab.model.gpt import GPT

    model = meta
    if model is None:
        with torch.device("meta"):
            model = GPT(model_cfg)
    fpt, n = flops_per_token(model, model_cfg.max_seq_len)["train"], matmul_params(model)
    per_step = tokens_per_step(cfg)
    if stages_of(cfg) is not None:
        steps = staged_steps(kind, value, cfg, model, n)
    else:
        steps = steps_for(kind, value, flops_per_token=fpt, tokens_per_step=per_step, n_matmul=n)
    cfg.trainer.max_steps = steps
    return {"kind": kind, "value": value, "steps": steps, "flops_per_token": fpt, "tokens_per_step": per_step,
            "n_matmul": n}


def max_time(seconds: float) -> str:
    """Lightning's `max_time` for a wall budget: its "DD:HH:MM:SS" text, in whole seconds (at least 1). Not its dict
    form: the Trainer is built from the config by Hydra, which hands a dict over as a DictConfig, and Lightning's Timer
    takes anything but a dict for a timedelta (`'total_seconds'` missing)."""
    s = max(1, round(seconds))
    return f"{s // 86400:02d}:{s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def spent(budget: dict[str, Any] | None, summary: dict[str, Any], flops_per_token: float,
          stages: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The summary's budget figures: the budget (None: trainer.max_steps decided), the run's train FLOPs per token and
    what it spent (tokens, FLOPs = tokens × FLOPs per token, or through the `stages` of a schedule, wall seconds)."""
    tokens = summary.get("tokens") or 0
    flops = tokens * flops_per_token
    if stages:
        from lmlab.record.targets import through

        flops = through(stages, summary.get("steps") or 0)[1]
    return {"budget": budget, "flops_per_token": flops_per_token,
            "budget_spent": {"tokens": tokens, "flops": flops,
                             "wall_s": summary.get("wall_time_s")}}
