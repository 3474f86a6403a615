"""One contestant's train step and eval forward, timed blocks, peak memory, and the matmul ceiling."""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class Contestant:
    """One model and its optimizer, with the train step and eval forward as lmlab's training loop runs them."""

    def __init__(self, name: str, model: nn.Module, loss: Callable, optimizer: dict, grad_clip: float,
                 autocast: Any) -> None:
        self.name, self.model, self.loss, self.grad_clip, self.autocast = name, model, loss, grad_clip, autocast
        self.optimizer, self.scheduler = optimizer["optimizer"], optimizer["lr_scheduler"]["scheduler"]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.train_s: list[float] = []
        self.eval_s: list[float] = []
        self.peak_bytes = 0

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        with self.autocast():
            loss = self.loss(batch)
        loss.backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def eval_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.model.eval()
        with torch.inference_mode(), self.autocast():  # as Lightning validates
            self.loss(batch)
        self.model.train()

    def optimizer_state_bytes(self) -> int:
        """Bytes of the optimizer's state tensors (moments, step counters), each storage once: 0 before the first
        step; for AdamW in fp32, 8 bytes per parameter (two moments) plus a 4-byte step per tensor."""
        tensors = [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())

    def live_bytes(self) -> int:
        """Bytes the model holds between steps: parameters, buffers and optimizer state, each storage once."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def peak_step_bytes(c: Contestant, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Own live bytes + the peak extra bytes allocated during one train step (grads, activations, temporaries).

    GPU: torch.cuda.max_memory_allocated over the step minus what was allocated before it. CPU: torch's CPU
    allocator reports every allocation to the profiler with a running total, so the peak of that total is the CPU
    analogue of max_memory_allocated. Allocator caching and fragmentation (RSS) are not counted on either device.
    """
    device = batch[0].device
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        c.train_step(batch)
        torch.cuda.synchronize()
        return c.live_bytes() + torch.cuda.max_memory_allocated() - before
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    c.train_step(batch)  # the optimizer state exists from here on: count it as live, not as the step's peak
    live = c.live_bytes()
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        c.train_step(batch)
    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            peak = max(peak, node.extra_fields.total_allocated)
        stack.extend(node.children)
    return live + peak


@contextmanager
def quiet_stderr():
    """The profiler's C++ side prints start/stop lines on fd 2 that no setting turns off."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def matmul_gflops(n: int, dtype: torch.dtype, device: torch.device, sync: Callable, tries: int = 3) -> float:
    """The ceiling: the best of `tries` torch.mm (n×n)·(n×n), 2n³ FLOPs each."""
    a, b, c = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
    torch.mm(a, b, out=c)
    best = math.inf
    for _ in range(tries):
        sync()
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)  # into a warm buffer: the compute, not the first touch of fresh pages
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def timed(fn: Callable, batches: list, sync: Callable) -> float:
    """Seconds per call over one block."""
    sync()
    t0 = time.perf_counter()
    for batch in batches:
        fn(batch)
    sync()
    return (time.perf_counter() - t0) / len(batches)


def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}
