"""Throughput: the model's FLOPs per token (shared by the bench and training), peak FLOP/s of known GPUs, peak
memory, and the live `perf/*` figures a run logs.

MFU = achieved model FLOP/s over the device's peak; the model FLOPs count the matmuls only (Kaplan et al., 2020:
6·N per trained token), plus the attention scores and their weighted sum, which have no weights.
"""

from __future__ import annotations

import re
import resource
import sys
import time

import torch
from lightning.pytorch.callbacks import Callback
from torch import nn

from lmlab import names
from lmlab.model.mixer import MIXERS
from lmlab.registry import option_params

FLOPS_FORMULA = ("train 6*N + 6*L*T*w FLOPs/token, eval 2*N + 2*L*T*w (N = matmul weights a token uses, tied head "
                 "once, an MoE's top_k experts of n_experts; "
                 "w = the block's attention width: 2*d for a transformer layer, s + e for a GAU; head=mtp: its "
                 "blocks, and the output head once more per depth)")

# Dense bf16 tensor-core peaks from the vendors' data sheets (FLOP/s, without sparsity), matched as whole words of
# torch.cuda.get_device_name ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB"; L4 is not L40S); first match wins.
PEAK_BF16_FLOPS = (
    ("GB200", 2.5e15), ("B200", 2.25e15), ("GH200", 989e12), ("H200", 989e12), ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H800", 989e12), ("A100", 312e12), ("A800", 312e12),
    ("L40S", 362e12), ("L40", 181e12), ("L4", 121e12), ("A10", 125e12), ("RTX 4090", 165e12),
)


def matmul_params(model: nn.Module) -> int:
    """N in 6·N: weights that take part in a matmul (Linear layers, the tied head once); lookups don't count. Of an
    MoE's stacked experts only the share one token multiplies (`active_share` = top_k / n_experts): active FLOPs."""
    return round(sum({id(m.weight): m.weight.numel() * getattr(m, "active_share", 1.0) for m in model.modules()
                      if isinstance(m, nn.Linear)}.values()))


def flops_per_token(model: nn.Module, seq_len: int) -> dict[str, int]:
    """Model FLOPs per token of a GPT at `seq_len`, for a train step (forward + backward) and an eval forward
    (FLOPS_FORMULA): the scores QKᵀ and the weighted sum A·V cost 2·T per unit of the block's own `attn_width`
    forward (a transformer layer: 2·n_head·head_dim, the usual 12·L·T·d in training; a GAU: s + e). A layer whose
    queries read a window of W keys (attention.window) costs W in place of T. A recurrent mixer's layer (mixer=gdn,
    mamba2, linear: sublayer `mix`) costs its own recurrence's FLOPs per token (its geometry's), whatever the length;
    a layer without a token mixer (mixer.pattern's `none`) costs no scores."""
    cfg = model.cfg
    blocks = list(model.h) + list(getattr(model.head, "blocks", ()))  # head=mtp: a block per extra depth
    spans = [min(seq_len, getattr(getattr(block, "attn", None), "window", None) or seq_len) for block in blocks
             if not hasattr(block, "mix") and _mixes_tokens(block)]
    n, attn = matmul_params(model), sum(spans) * cfg.attn_width
    if mixers := sum(hasattr(block, "mix") for block in blocks):
        name, params = option_params("mixer", MIXERS, cfg.mixer)
        per = MIXERS[name].geometry(cfg, **{k: v for k, v in params.items() if k != "pattern"}).flops_per_token
        attn += mixers * per / 2  # the `2 · attn` forward convention below: a mixer's forward FLOPs are `per`
    n += model.head.depth * cfg.vocab_size * cfg.d_model  # each extra depth reads the shared output head again
    return {"train": 6 * n + 6 * attn, "eval": 2 * n + 2 * attn}


def _mixes_tokens(block: nn.Module) -> bool:
    """Whether some sublayer of the block reads the other tokens (attention, a GAU, a recurrent mixer)."""
    return any(getattr(getattr(block, name), "mixes_tokens", False) for name in block.sublayer_names)


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

    def on_train_start(self, trainer, pl_module) -> None:
        device = pl_module.device
        if self.peak is None and device.type == "cuda":
            self.peak = peak_flops(torch.cuda.get_device_name(device))
        self._since, self._tokens = time.perf_counter(), pl_module.tokens_seen

    def on_validation_start(self, trainer, pl_module) -> None:
        self._val_started = time.perf_counter()

    def on_validation_end(self, trainer, pl_module) -> None:
        if hasattr(self, "_since"):  # the clock of the training steps stops while validating
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
