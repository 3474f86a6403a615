"""Throughput: peak FLOP/s of known GPUs, peak memory, and the live `perf/*` figures a run logs.

MFU = achieved model FLOP/s (the model's FLOPs per token: lmlab.model.flops) over the device's peak.
"""

from __future__ import annotations

import re
import resource
import sys
import time
from typing import Any

import torch
from lightning.pytorch.callbacks import Callback

from lmlab import names

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s, without sparsity), matched as whole words of
# torch.cuda.get_device_name ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"; L4 is not L40S); first match wins.
PEAK_BF16_FLOPS = (
    ("GB200", 2.5e15), ("B200", 2.25e15), ("GH200", 989e12), ("H200", 989e12), ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12),
    ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A10", 125e12), ("RTX 4090", 165e12),
)


def peak_flops(device_name: str) -> float | None:
    """The dense bf16 peak of a known GPU by its name (torch.cuda.get_device_name); None for anything else."""
    return next((peak for key, peak in PEAK_BF16_FLOPS if re.search(rf"\b{re.escape(key)}\b", device_name)), None)


def max_memory_gib(device: torch.device) -> float:
    """Peak memory so far: the CUDA allocator's on a GPU (a counter, no sync), the process's peak RSS on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss / (2**30 if sys.platform == "darwin" else 2**20)


class Throughput(Callback):
    """Logs `perf/tokens_per_s` (training since the previous logging step; validations are not counted),
    `perf/mfu` (when the peak is known) and `perf/max_memory` (GiB) on the steps Lightning writes. `peak`: FLOP/s
    of one device (None: by the GPU's name).

    The clock is read on the host: the loss check of every step (LitGPT.training_step) already waits for the
    device, so no synchronisation is added."""

    def __init__(self, flops_per_token: float, peak: float | None = None) -> None:
        self.flops_per_token, self.peak = flops_per_token, peak
        self.device: str | None = None  # cpu, or the GPU's name: set when training starts
        self._since: float | None = None  # the clock of the training steps, from when training starts

    def on_train_start(self, trainer, pl_module) -> None:
        device = pl_module.device
        self.device = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        if self.peak is None and device.type == "cuda":
            self.peak = peak_flops(torch.cuda.get_device_name(device))
        self._since, self._tokens = time.perf_counter(), pl_module.tokens_seen

    def figures(self, tokens_per_s: float | None, world_size: int) -> dict[str, Any]:
        """summary.json's speed of an attempt from its `tokens_per_s`: `model_flops_per_s` (tokens/s x train FLOPs per
        token, what compare's speed section weighs variants by), `mfu` (over the peak of `world_size` devices, where
        the peak is known) and `device` (cpu, or the GPU's name)."""
        rate = tokens_per_s * self.flops_per_token if tokens_per_s else None
        return {"model_flops_per_s": rate, "mfu": rate / (self.peak * world_size) if rate and self.peak else None,
                "device": self.device}

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_started = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if self._since is not None:  # the clock of the training steps stops while validating
            self._since += time.perf_counter() - self._val_started

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not pl_module.logs_now():
            return
        now, tokens = time.perf_counter(), pl_module.tokens_seen
        if now > self._since and tokens > self._tokens:
            rate = (tokens - self._tokens) / (now - self._since)  # the global batch's tokens under DDP
            pl_module.log(names.TOKENS_PER_S, torch.tensor(rate, dtype=torch.float64))  # a CPU tensor: no copy
            if self.peak:
                mfu = rate * self.flops_per_token / (self.peak * trainer.world_size)
                pl_module.log(names.MFU, torch.tensor(mfu, dtype=torch.float64))
        pl_module.log(names.MAX_MEMORY, torch.tensor(max_memory_gib(pl_module.device), dtype=torch.float64))
        self._since, self._tokens = now, tokens
