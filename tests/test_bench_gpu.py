"""The GPU check (scripts/bench_gpu.sh) prepared on the CPU: the GPU breakdown counts each kernel once."""

from __future__ import annotations

import math
from types import SimpleNamespace

from torch.autograd import DeviceType

from lmlab.bench.breakdown import classify_kernel, device_seconds


def _event(id: int, name: str, device: DeviceType, link: int = 0, us: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(id=id, name=name, device_type=device, linked_correlation_id=link, is_async=False,
                           time_range=SimpleNamespace(start=0.0, end=us))


def test_the_gpu_breakdown_counts_each_kernel_once_by_its_op_or_its_name() -> None:
    """The profiler lists a kernel as an event of its own and adds its time to the op that launched it: summing the
    ops' self device time counted both. Each kernel counts once here: by its op, or by its own name when the op is a
    compiled region's."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    events = [_event(1, "aten::mm", cpu), _event(2, "aten::_scaled_dot_product_flash_attention", cpu),
              _event(3, "aten::_fused_adamw_", cpu), _event(4, "Torch-Compiled Region: 0/0", cpu),
              _event(5, "aten::add", cpu),
              _event(90, "cudaLaunchKernel", cpu, link=1),  # the runtime's launch call: linked, not an op
              _event(100, "nvjet_tst_128x256_64x4", gpu, link=1, us=400),
              _event(101, "pytorch_flash::flash_fwd_kernel", gpu, link=2, us=300),
              _event(102, "multi_tensor_apply_kernel", gpu, link=3, us=50),
              _event(103, "triton_per_fused_gelu_0", gpu, link=4, us=120),
              _event(104, "sm90_xmma_gemm_bf16bf16_bf16f32", gpu, link=4, us=200),  # a GEMM inductor launched
              _event(105, "vectorized_elementwise_kernel", gpu, link=5, us=30),
              _event(106, "Memcpy DtoD", gpu, link=0, us=10)]  # no op at all
    spent = device_seconds(events)
    assert {k: round(v * 1e6) for k, v in spent.items()} == {"matmul": 600, "attention": 300, "optimizer": 50,
                                                            "other": 160}
    assert math.isclose(sum(spent.values()), 1110e-6)  # every kernel once: the kernels' total
    assert classify_kernel("anything", "aten::addmm") == "matmul"
    assert classify_kernel("triton_tem_fused_flex_attention_0", "Torch-Compiled Region: 1/0") == "attention"
    assert classify_kernel("elementwise_kernel", None) == "other"

