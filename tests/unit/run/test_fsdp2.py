"""trainer=fsdp2 on CPU (gloo, 2 ranks): the figures of one process on the same global batch, sharded checkpoints
that resume exactly and are read without unpickling code, consolidation to the one-process checkpoint; per-block
sharding with bf16 parameters / fp32 reduction, checkpointing and compile; trainer=fsdp on CPU names fsdp2."""

from __future__ import annotations

import pytest
import torch

from lmlab import compose

FSDP2 = ["trainer=fsdp2", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


def test_fsdp_on_cpu_names_fsdp2_before_training(tmp_path) -> None:
    from lmlab.run.training import check_config

    with pytest.raises(ValueError, match=r"trainer\.strategy=fsdp needs a CUDA GPU .*trainer=fsdp2 "
                                         r"trainer\.accelerator=cpu"):
        check_config(compose(["trainer=fsdp"]))
    with pytest.raises(ValueError, match=r"trainer\.accelerator=gpu needs a CUDA GPU .*on CPU use trainer=fsdp2 "
                                         r"trainer\.accelerator=cpu"):
        check_config(compose(["trainer=fsdp2"]))
    check_config(compose(FSDP2))  # CPU FSDP2 is accepted


@pytest.fixture
def mesh(tmp_path):
    """A one-rank gloo process group in this process and its 1-D device mesh (fully_shard needs a mesh)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _tiny_gpt(tiny_cfg, **overrides):
    from lmlab.model.gpt import GPT, validate

    torch.manual_seed(0)
    return GPT(validate(tiny_cfg(**overrides)))


# compiled: ~25 s of compiling, the `slow` tier (make test-all)
@pytest.mark.parametrize("compile", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
def test_shard_model_composes_checkpointing_and_compile_per_block(tiny_cfg, mesh, compile: bool) -> None:
    """fully_shard per block over checkpointing (and compile) applied to each block's forward: the loss and every
    gradient of the unsharded model, each block's forward run twice (the recompute), one all-gather per block."""
    from lmlab.run.distributed import is_sharded_module, shard_model
    from lmlab.run.monitor import local

    ref, model = _tiny_gpt(tiny_cfg), _tiny_gpt(tiny_cfg, checkpointing=True)
    idx = torch.randint(0, 50, (2, 16))
    ref(idx, idx).backward()
    calls = []
    if not compile:  # compiled, a hook's Python side effect runs when traced, not each call
        attn = getattr(model.h[1], model.h[1].sublayer_names[0])  # recompute stops early, after the last saved tensor
        attn.register_forward_pre_hook(lambda *args: calls.append(1))
    shard_model(model, mesh, bf16=False, checkpointing=True, compile=compile)
    assert all(is_sharded_module(m) for m in (model, *model.h))
    loss = model(idx, idx)
    loss.backward()
    assert loss.item() == pytest.approx(ref(idx, idx).item(), rel=1e-6)
    assert len(calls) == (0 if compile else 2)  # forward, then the recompute in backward
    grads = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(local(p.grad), grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)


def test_shard_model_gathers_bf16_parameters_and_keeps_fp32_shards_and_gradients(tiny_cfg, mesh) -> None:
    """bf16-mixed under FSDP2: the block computes with bf16 weights, the optimizer's sharded parameters and the
    reduced gradients are fp32."""
    from lmlab.run.distributed import shard_model

    model = _tiny_gpt(tiny_cfg)
    seen = []
    model.h[0].attn.register_forward_pre_hook(lambda m, args: seen.append(m.c_attn.weight.dtype))
    shard_model(model, mesh, bf16=True, checkpointing=False, compile=False)
    model(torch.randint(0, 50, (2, 16)), torch.randint(0, 50, (2, 16))).backward()
    assert seen == [torch.bfloat16]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {p.grad.dtype for p in model.parameters()} == {torch.float32}


@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_fsdp2_strategy_gathers_in_bf16_under_bf16_mixed_only(tiny_cfg, mesh, precision: str, dtype) -> None:
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
    from torch.distributed.device_mesh import init_device_mesh

    from lmlab.run.distributed import FSDP2Strategy

    strategy = FSDP2Strategy()
    strategy.precision_plugin = MixedPrecision(precision, "cpu") if precision.endswith("mixed") else Precision()
    strategy._device_mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("data_parallel", "tensor_parallel"))
    model, seen = _tiny_gpt(tiny_cfg), []
    model.h[1].attn.register_forward_pre_hook(lambda m, args: seen.append(m.c_attn.weight.dtype))
    strategy.shard(model, checkpointing=False, compile=False)
    strategy.shard(model, checkpointing=False, compile=False)  # again (trainer.validate after fit): a no-op
    model(torch.randint(0, 50, (2, 16)))
    assert seen == [dtype]
