"""The GPU check (scripts/bench_gpu.sh) prepared on the CPU: its dry run writes every stage's JSON with the keys
docs/bench.md names; the GPU breakdown counts each kernel once; the train.py figures and the summary read back what
the runs logged."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

from torch.autograd import DeviceType

from lmlab.bench.breakdown import classify_kernel, device_seconds
from lmlab.bench.suite import FILES, missing_keys, summarize
from lmlab.bench.train_run import perf_figures


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


def test_without_links_each_kernel_is_classed_by_its_name() -> None:
    """torch 2.11's profiler events have no linked_correlation_id (the H200 image of 2026-12-04, where the breakdown
    failed on it): each kernel once, by its own name."""
    cpu, gpu = DeviceType.CPU, DeviceType.CUDA

    def bare(id: int, name: str, device: DeviceType, us: float = 0.0) -> SimpleNamespace:
        return SimpleNamespace(id=id, name=name, device_type=device, is_async=False,
                               time_range=SimpleNamespace(start=0.0, end=us))

    events = [bare(1, "aten::mm", cpu), bare(100, "nvjet_tst_128x256_64x4", gpu, 400),
              bare(101, "pytorch_flash::flash_fwd_kernel", gpu, 300), bare(102, "vectorized_elementwise_kernel", gpu, 30)]
    assert {k: round(v * 1e6) for k, v in device_seconds(events).items()} == {"matmul": 400, "attention": 300,
                                                                            "optimizer": 0, "other": 30}


def test_train_figures_are_the_steady_half_of_what_the_run_logged(tmp_path: Path) -> None:
    path = tmp_path / "metrics.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "perf/tokens_per_s", "perf/mfu", "perf/max_memory", "val/loss"])
        for step, rate, mem in [(0, 5.0, 1.0), (10, 900.0, 2.0), (20, 1000.0, 2.5), (30, 1100.0, 2.5),
                                (40, 1200.0, 2.25)]:
            w.writerow([step, rate, rate / 1e4, mem, ""])
        w.writerow([40, "", "", "", 3.0])  # a validation row: no perf figures
    got = perf_figures(path)
    assert got["tokens_per_s"] == 1100.0 and math.isclose(got["mfu"], 0.11)  # median of the last 3 of 5 (compile first)
    assert got["max_memory_gib"] == 2.5 and got["logged_steps"] == [0, 10, 20, 30, 40]
    assert perf_figures(tmp_path / "absent.csv")["tokens_per_s"] is None


def test_the_summary_names_what_is_missing_incomplete_or_failed(tmp_path: Path) -> None:
    (tmp_path / "env.json").write_text(json.dumps({"date": "x"}))
    (tmp_path / "train-eager.json").write_text(json.dumps(
        {"name": "eager", "overrides": [], "rc": 1, "wall_s": 3.0, "tokens_per_s": None, "mfu": None,
         "max_memory_gib": None, "logged": {}, "summary": {"status": "failed"}}))
    moe = {"date": "x", "device": "cuda", "precision": "bf16",
           "rows": [{"name": "dense swiglu", "train_tok_s": 1.0, "step_vs_dense": 1.0, "fwd_bwd_vs_dense": 1.0,
                     "peak_mem_mb": 1.0, "router_share": 0.0},
                    {"name": "moe E=8 k=2", "train_tok_s": 1.0, "step_vs_dense": 1.4, "fwd_bwd_vs_dense": 1.3,
                     "peak_mem_mb": 1.0, "router_share": 0.05}]}
    (tmp_path / "moe.json").write_text(json.dumps(moe))
    out = summarize(tmp_path)
    assert "lacks ['commit'" in out["problems"]["env"] and out["problems"]["train-eager"] == "train.py exit 1"
    assert set(out["missing"]) == set(FILES) - {"env", "train-eager", "moe"}
    assert out["targets"] == [{"target": "moe E=8 k=2 step <= 1.5x dense", "met": True, "value": 1.4}]
    assert missing_keys("moe", {**moe, "rows": [{"name": "x"}]})[:1] == ["rows[0].train_tok_s"]
