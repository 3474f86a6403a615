"""Spike skipping (`spike_skip:` in conf/train.yaml; OLMo-core's SkipStepOptimizer rule): a step whose loss or global
gradient norm (before clipping) is more than `sigma` standard deviations above the mean of the previous `window`
steps' values has its optimizer update skipped instead of ending the run. The step still counts: its batch is
consumed, the schedule moves on, and its values join the windows (OLMo's choice), so a loss that stays high is
soon the new normal and the divergence rule judges it.

`SpikeSkip` is the rule alone, on floats; lmlab.run.lit.LitGPT feeds it the step's globally reduced loss and
gradient norm, so every rank takes the same decision, and skips the update (`skip_update`).
"""

from __future__ import annotations

import copy
import math
from collections import deque
from typing import Annotated, Any, Literal

import torch

from lmlab.registry import PositiveFloat, Range, check_values, parameter_types

Watched = Literal["loss", "grad_norm"]


class SpikeSkip:
    """Step s is skipped when, for a watched value x_s (the step's loss, its global gradient norm before clipping),
    x_s > mean + sigma·std of the window (the previous `window` steps' values, std with Bessel's correction, as
    torch.std_mean), once the window holds `min_steps` values (None: the whole window). A non-finite value is
    skipped too and never joins its window; every finite value does, a skipped step's included."""

    def __init__(self, *, enabled: bool = False, window: Annotated[int, Range(ge=2)] = 128,
                 sigma: PositiveFloat = 6.0, watch: list[Watched] = ("loss", "grad_norm"),
                 min_steps: Annotated[int, Range(ge=2)] | None = None) -> None:
        self.sigma, self.watch = float(sigma), tuple(watch)
        self.min_steps = window if min_steps is None else min_steps
        self.windows: dict[str, deque[float]] = {k: deque(maxlen=window) for k in self.watch}
        self.skipped: list[int] = []  # the steps whose update was skipped

    def threshold(self, key: str) -> float | None:
        """The value above which `key` is a spike now (None: its window holds fewer than min_steps values)."""
        xs = self.windows[key]
        if len(xs) < self.min_steps:
            return None
        mean = math.fsum(xs) / len(xs)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1))
        return mean + self.sigma * std

    def check(self, step: int, **values: float) -> bool:
        """Whether step `step`'s update is skipped (recorded), from its watched `values` (loss=, grad_norm=)."""
        values = {k: float(values[k]) for k in self.watch}
        skip = False
        for key, x in values.items():
            limit = self.threshold(key)
            skip |= not math.isfinite(x) or (limit is not None and x > limit)
        for key, x in values.items():
            if math.isfinite(x):
                self.windows[key].append(x)
        if skip:
            self.skipped.append(int(step))
        return skip

    def state_dict(self) -> dict[str, Any]:
        return {"windows": {k: list(xs) for k, xs in self.windows.items()}, "skipped": list(self.skipped)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A checkpoint's windows and skipped steps, in place of this rule's (loading twice changes nothing)."""
        for key, xs in self.windows.items():
            xs.clear()
            xs.extend(state.get("windows", {}).get(key, []))
        self.skipped = [int(s) for s in state.get("skipped", [])]


def check_spike_skip(block: dict[str, Any] | None) -> None:
    """The `spike_skip:` keys, refused by name before training: window >= 2, sigma > 0, watch a non-empty list of
    loss and grad_norm, 2 <= min_steps <= window."""
    if not block:
        return
    check_values("spike_skip.", block, parameter_types(SpikeSkip))
    if not block.get("watch"):
        raise ValueError("spike_skip.watch=[] watches nothing: list loss, grad_norm or both")
    if (n := block.get("min_steps")) is not None and n > block.get("window", 128):
        raise ValueError(f"spike_skip.min_steps={n} must be <= spike_skip.window={block.get('window', 128)}: the "
                         f"window never holds more values than that")


def skip_update(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Make the coming optimizer step a no-op: drop the gradient of every tensor it steps (each optimizer then leaves a
    parameter and its state as they are) and return its group settings, which the caller puts back after the step (an
    optimizer may count steps per group even without gradients: schedule-free's k, Muon's momentum warmup)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]


def restore_groups(optimizer: torch.optim.Optimizer, kept: list[dict[str, Any]]) -> None:
    for group, settings in zip(optimizer.param_groups, kept, strict=True):
        group.update(settings)
