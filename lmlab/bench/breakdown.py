"""Where a train step's time goes: torch.profiler's self time per op, in four classes.

MFU alone says how far a step is from the matmul ceiling, not why. The breakdown splits one profiled train step
into matmuls (whose rate against the ceiling says how well the GEMMs themselves run), the attention kernels, the
optimizer with gradient clipping, and everything else (norms, activations, RoPE, the loss, copies, Python).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from lmlab.bench.timing import Contestant, quiet_stderr

MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv", "aten::_addmm_activation"}
ATTENTION = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention",
             "aten::_cudnn_attention")
OPTIMIZER = ("aten::_fused_adam", "aten::_foreach_", "Optimizer.", "aten::linalg_vector_norm")  # + clipping's norms


def classify(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if name.startswith(ATTENTION):
        return "attention"
    if name.startswith(OPTIMIZER):
        return "optimizer"
    return "other"


def step_breakdown(c: Contestant, batch: tuple[torch.Tensor, torch.Tensor], step_s: float, matmul_flops: float,
                   ceiling_gflops: float | None, sync: Callable) -> dict[str, Any]:
    """Profile one train step of `c`; each class's share of the op time, scaled to the timed median `step_s`.

    CPU: the ops' self CPU time (intra-op threads work inside an op, so this is wall time on the calling thread).
    CUDA: the kernels' device time, attributed to the op that launched them; what the device spent idle in the
    step (launch overhead, syncs) is `idle`. `matmul_flops`: the step's model FLOPs in matmuls (6 N per token).
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = batch[0].device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with quiet_stderr(), profile(activities=activities) as prof:
        t0 = time.perf_counter()
        c.train_step(batch)
        sync()
        wall = time.perf_counter() - t0
    spent = {"matmul": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    for e in prof.key_averages():
        spent[classify(e.key)] += (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6
    if cuda:  # device time is absolute; the rest of the timed step the GPU waited
        seconds = dict(spent, idle=max(0.0, step_s - sum(spent.values())))
    else:  # shares of the profiled step's wall time (Python between ops counts as other), applied to the median
        spent["other"] += max(0.0, wall - sum(spent.values()))
        seconds = {k: v / max(wall, sum(spent.values())) * step_s for k, v in spent.items()}
    mm_rate = matmul_flops / seconds["matmul"] / 1e9 if seconds["matmul"] else float("nan")
    return {"step_s": step_s, "seconds": seconds, "share": {k: v / step_s for k, v in seconds.items()},
            "matmul_gflops": mm_rate, "matmul_vs_ceiling": mm_rate / ceiling_gflops if ceiling_gflops else None}
