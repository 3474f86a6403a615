"""What the optimizers and the init schemes read off the model's layers and off the optimizer options, typed and listed
in one place, each with its default when unset (lmlab.model.capabilities lists them beside the model's protocols).

- `Marks`: what a Linear says about its weight (its fused row blocks, which of them carry values, its rows per head,
  whether it writes into the residual stream or is the untied readout, how many experts' matrices it stacks). A layer
  sets them with `mark(linear, fused=...)` (or, as older code does, the attribute itself); `marks(linear)` reads all of
  them, the defaults where unset. Read by lmlab.optim (`param_groups`, `layout`), lmlab.model.init, lmlab.model.param
  and norm=ngpt.
- `ClipsLogits`: an attention layer QK-clip rescales (lmlab.optim.qk_clip).
- `Decays`: a model that says whether its matrices take weight decay.
- `OptimizerCaps`: what an optimizer option needs beyond its keys (the module docstring of lmlab.optim), declared on
  the option with `declare(option, mup=True, ...)` and read with `capabilities(option)`.
- what a built optimizer offers the training loop: `FollowsHorizon` (Muon's momentum cool-down over the run's steps),
  `WarmupOnly` (schedule-free: the schedule's warm-up, never its decay), `EvalWeights` (schedule-free's train/eval
  modes: it evaluates other weights than it trains).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, Protocol, TypeVar, runtime_checkable

T = TypeVar("T")


@dataclass(frozen=True)
class Marks:
    """A Linear's marks, the defaults those of a plain single-matrix layer inside a block."""

    fused: tuple[int, ...] | None = None  # the row blocks of a weight that stores several matrices (q, k, v; gate, up)
    value_parts: tuple[bool, ...] | None = None  # which blocks carry values (DeepNet's gain; not head-split by Muon)
    head_rows: int = 0  # rows per head of the blocks that are not values (Muon's optim.split=heads)
    is_residual_proj: bool = False  # writes into the residual stream (GPT-2's 1/√(2L), ngpt's columns on the sphere)
    is_readout: bool = False  # the untied LM head (the optimizer's `readout` role, µP's MuReadout init)
    n_experts: int = 1  # E experts' matrices stacked in one weight (an MoE's: Muon orthogonalises each)


MARKS = tuple(f.name for f in fields(Marks))


@runtime_checkable
class Decays(Protocol):
    """A model that says whether its matrices take weight decay (norm=ngpt's do not: renormalised after every step);
    a model without it takes the decay."""

    decays: bool


def mark(module: T, **marks: Any) -> T:
    """Set `marks` on `module` (a Linear), by the names of `Marks` (another name is a TypeError); returns it."""
    Marks(**marks)
    for name, value in marks.items():
        setattr(module, name, value)
    return module


def marks(module: object) -> Marks:
    """`module`'s marks, each at its default where unset: the one place they are read from a layer."""
    return Marks(**{name: getattr(module, name, default) for name, default in
                    ((f.name, f.default) for f in fields(Marks))})


@runtime_checkable
class ClipsLogits(Protocol):
    """An attention layer whose logits QK-clip can scale per head through its weights (lmlab.optim.qk_clip: MHA and
    its variants); `no_qk_clip` says why this one cannot (None: it can)."""

    no_qk_clip: str | None

    def clip_logits(self, gamma: Any) -> None: ...


@runtime_checkable
class FollowsHorizon(Protocol):
    """A built optimizer that follows the run's length (Muon's momentum cool-down): the loop hands it max_steps, and
    again when budget.wall refits the horizon (lmlab.run.wall)."""

    def set_max_steps(self, max_steps: int) -> None: ...


@runtime_checkable
class WarmupOnly(Protocol):
    """A built optimizer that takes the schedule's warm-up only, never its decay (schedule-free) when `warmup_only`."""

    warmup_only: bool


@runtime_checkable
class EvalWeights(Protocol):
    """A built optimizer with train and eval modes (schedule-free: lmlab.optim.schedule_free): the loop evaluates the
    weights `eval_weights` gives (by data_ptr of the trained ones) and switches it with `train()` and `eval()`."""

    def eval_weights(self) -> dict[int, Any]: ...


@dataclass(frozen=True)
class OptimizerCaps:
    """What an optimizer option needs beyond its own keys (lmlab.optim's docstring); the defaults: none of it."""

    roles: bool = False  # its groups split by role (`hidden` matrices, the `readout`, the rest): Muon
    mup: bool = False  # an Adam-like, entrywise-normalised update: param=mup's per-group learning rates apply
    layouts: bool = False  # its hidden groups carry each matrix's row blocks (Muon's optim.split)
    trust_ratio: bool = False  # the decay sits inside a per-tensor trust ratio (LAMB)
    shards: str | None = None  # why it cannot run on sharded parameters (refused under trainer=fsdp2)
    averages: str | None = None  # why its evaluation weights are an average already (refused with optim.ema)
    check: Callable[[dict], None] | None = None  # its rule across its own keys, run before training
    mup_lr_mult: Callable[[dict, dict, float], float | None] | None = None  # its own µP lr rule per group


def declare(option: T, **caps: Any) -> T:
    """Declare `caps` (by the names of `OptimizerCaps`; another name is a TypeError) on an optimizer option; returns
    it. Set as attributes of the option, where `capabilities` reads them."""
    OptimizerCaps(**caps)
    for name, value in caps.items():
        setattr(option, name, value)
    return option


def capabilities(option: object) -> OptimizerCaps:
    """What the optimizer option `option` declared, each at its default where it declared nothing."""
    return OptimizerCaps(**{name: getattr(option, name, default) for name, default in
                            ((f.name, f.default) for f in fields(OptimizerCaps))})
