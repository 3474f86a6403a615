"""Where a train step's time goes: torch.profiler's self time per op, in four classes.

MFU alone says how far a step is from the matmul ceiling, not why. The breakdown splits one profiled train step
into matmuls (whose rate against the ceiling says how well the GEMMs themselves run), the attention kernels, the
optimizer with gradient clipping, and everything else (norms, activations, RoPE, the loss, copies, Python).

On a GPU each kernel counts once, by the op that launched it (the profiler's correlation of a kernel to its CPU op),
or by its own name when that op says nothing (a kernel launched from a compiled region, or a GEMM that inductor
calls by its cuBLAS name). Summing the ops' self device time instead would count every kernel twice: the profiler
lists each kernel as an event of its own and adds its time to the op that launched it as well.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from lmlab.bench.timing import Contestant, quiet_stderr

MATMUL = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::mv", "aten::addmv", "aten::_addmm_activation"}
ATTENTION = ("aten::_scaled_dot_product", "aten::_flash_attention", "aten::_efficient_attention",
             "aten::_cudnn_attention")
OPTIMIZER = ("aten::_fused_adam", "aten::_foreach_", "Optimizer.", "aten::linalg_vector_norm")  # + clipping's norms


# GPU kernels by their own names: cuBLAS/cuBLASLt/CUTLASS GEMMs (nvjet is cuBLASLt's on Hopper), flash / cuDNN /
# memory-efficient / FlexAttention kernels, the fused and multi-tensor AdamW kernels.
KERNELS = (("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|s16816|s1688", re.I)),
           ("attention", re.compile(r"flash|fmha|attention|flex|sdpa", re.I)),
           ("optimizer", re.compile(r"adam|multi_tensor_apply", re.I)))


def classify(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if name.startswith(ATTENTION):
        return "attention"
    if name.startswith(OPTIMIZER):
        return "optimizer"
    return "other"


def classify_kernel(name: str, op: str | None) -> str:
    """A GPU kernel's class: its launching op's, else what its own name says."""
    if op is not None and (by_op := classify(op)) != "other":
        return by_op
    return next((kind for kind, pattern in KERNELS if pattern.search(name)), "other")


def device_seconds(events: Iterable[Any]) -> dict[str, float]:
    """Seconds of device time per class from profiler events (`prof.events()`), each kernel once: a device event
    (device_type not CPU) is classed by the CPU op whose id its `linked_correlation_id` names (ops are the CPU events
    without a link of their own; the runtime's launch calls have one). A torch whose events carry no such link (2.11,
    the image of the H200 lent on 2026-12-04) classes each kernel by its own name alone."""
    from torch.autograd import DeviceType

    events = list(events)

    def link(e: Any) -> int:
        return getattr(e, "linked_correlation_id", 0) or 0

    ops = {e.id: e.name for e in events if e.device_type == DeviceType.CPU and not link(e)}
    spent = {"matmul": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
    for e in events:
        if e.device_type != DeviceType.CPU and not e.is_async:
            op = ops.get(link(e)) if link(e) else None
            spent[classify_kernel(e.name, op)] += (e.time_range.end - e.time_range.start) / 1e6
    return spent


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
    if cuda:
        spent = device_seconds(prof.events())
    else:
        spent = {"matmul": 0.0, "attention": 0.0, "optimizer": 0.0, "other": 0.0}
        for e in prof.key_averages():
            spent[classify(e.key)] += e.self_cpu_time_total / 1e6
    if cuda:  # device time is absolute; the rest of the timed step the GPU waited
        seconds = dict(spent, idle=max(0.0, step_s - sum(spent.values())))
    else:  # shares of the profiled step's wall time (Python between ops counts as other), applied to the median
        spent["other"] += max(0.0, wall - sum(spent.values()))
        seconds = {k: v / max(wall, sum(spent.values())) * step_s for k, v in spent.items()}
    mm_rate = matmul_flops / seconds["matmul"] / 1e9 if seconds["matmul"] else float("nan")
    return {"step_s": step_s, "seconds": seconds, "share": {k: v / step_s for k, v in seconds.items()},
            "matmul_gflops": mm_rate, "matmul_vs_ceiling": mm_rate / ceiling_gflops if ceiling_gflops else None}
