"""FSDP2 for `trainer=fsdp2`: torch's `fully_shard` per transformer block and on the root, through Lightning's
`ModelParallelStrategy`, and the sharded checkpoints it writes (torch.distributed.checkpoint, DCP).

- `FSDP2Strategy` is ModelParallelStrategy with every rank in one data-parallel dimension (no tensor parallelism), on
  GPUs (NCCL) and on CPU (gloo: Lightning accepts CPU as it is, no subclassing needed for that); it shards the model
  in `LitGPT.configure_model` through `shard_model`, writes `checkpoints/last.ckpt/` as a DCP directory (one shard
  file per rank + Lightning's `meta.pt`) by a temporary directory renamed over the old one, and reads it back
  without unpickling code.
- `shard_model`: per block, activation checkpointing and `torch.compile` are applied to the block's own forward
  first, then `fully_shard`; the root last. Under bf16-mixed the parameters are gathered in bf16 and gradients
  reduced in fp32 (`MixedPrecisionPolicy`); the sharded fp32 parameters are the optimizer's.

Its checkpoints are read back by `lmlab.record.sharded` (which runs no code from them).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lmlab.record.sharded import META, SafeLoadPlanner, SafeReader, is_sharded


# --- sharding the model ---------------------------------------------------------------------------------------

def shard_model(model: nn.Module, mesh: Any, *, bf16: bool, checkpointing: bool, compile: bool,
                reshard_after_forward: bool = True) -> None:
    """fully_shard each block of `model.h`, then the root, in place. Checkpointing and compile wrap each block's
    forward before its fully_shard, so FSDP's all-gather and reshard hooks stay outside them (one all-gather per
    block in backward, the recompute included) and the module tree, its parameter names and the monitor's hooks are
    the unsharded model's."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.checkpoint import checkpoint

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 \
        else MixedPrecisionPolicy()
    for block in model.h:
        forward = block.forward
        if checkpointing:  # the same recompute GPT.forward does, moved inside the block's FSDP hooks
            forward = partial(checkpoint, forward, use_reentrant=False)
        if compile:
            forward = torch.compile(forward)
        block.forward = forward
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    if checkpointing:
        model.cfg = replace(model.cfg, checkpointing=False)  # recomputed per block above, not a second time
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)


def is_sharded_module(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def gathered(*modules: nn.Module) -> Iterator[None]:
    """The full parameters of FSDP2 modules for code that is not their forward (the monitor's attention maps);
    a collective: every rank enters it. Modules that are not sharded pass through."""
    sharded = [m for m in modules if is_sharded_module(m)]
    for m in sharded:
        m.unshard()
    try:
        yield
    finally:
        for m in sharded:
            m.reshard()


class FSDP2Strategy(ModelParallelStrategy):
    """ModelParallelStrategy as pure FSDP2: a 1-D data-parallel mesh over every rank (Lightning's "auto" would make
    a tensor-parallel dimension of each node's devices), sharded by `LitGPT.configure_model` through `shard`."""

    def __init__(self, *, reshard_after_forward: bool = True, save_distributed_checkpoint: bool = True,
                 process_group_backend: str | None = None) -> None:
        super().__init__(data_parallel_size="auto", tensor_parallel_size=1,
                         save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend)
        self.reshard_after_forward = reshard_after_forward

    def setup_environment(self) -> None:
        if self._data_parallel_size == "auto":
            self._data_parallel_size = self.world_size
        super().setup_environment()

    def shard(self, model: nn.Module, *, checkpointing: bool, compile: bool) -> None:
        if is_sharded_module(model):  # configure_model runs again for trainer.validate after fit
            return
        bf16 = str(self.precision_plugin.precision) == "bf16-mixed"
        shard_model(model, self.device_mesh["data_parallel"], bf16=bf16, checkpointing=checkpointing,
                    compile=compile, reshard_after_forward=self.reshard_after_forward)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """Write into a temporary directory, then rename it over the old checkpoint (a crash mid-save keeps the last
        good one, as lmlab's single-file writer does)."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        from lmlab.record.temporaries import temporary

        path = Path(self.broadcast(str(filepath)))
        tmp, old = (Path(p) for p in self.broadcast((str(temporary(path)), str(temporary(path, "old")))))  # rank 0's
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp)
        self.barrier()
        super().save_checkpoint(checkpoint, tmp, storage_options)
        self.barrier()  # every rank's shard is written
        if self.global_rank == 0:  # two renames: a crash between them leaves the previous checkpoint as `old`
            shutil.rmtree(old, ignore_errors=True)
            if path.is_dir():
                os.replace(path, old)
            elif path.exists():
                path.unlink()
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Lightning's sharded load (each rank reads its shards into the sharded model and optimizer), through
        lmlab's reader and planner: no plain unpickling. Returns the rest of the checkpoint (meta.pt)."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if not is_sharded(path):  # one file: consolidated in place (python -m lmlab.record.consolidate), or another
                                  # trainer's
            return self._load_one_file(path)
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        module = self.model
        state = {"state_dict": get_model_state_dict(module)}
        load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
        module.load_state_dict(state["state_dict"], strict=self.lightning_module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            state = {f"optimizer_{i}": get_optimizer_state_dict(module, optimizer)}
            load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())
            set_optimizer_state_dict(module, optimizer, optim_state_dict=state[f"optimizer_{i}"],
                                     options=StateDictOptions(cpu_offload=True))
        return torch.load(path / META, map_location="cpu", weights_only=True)

    def _load_one_file(self, path: Path) -> dict[str, Any]:
        """A one-file checkpoint into the sharded model and optimizer: every rank reads the file (weights_only) and
        keeps its own shards. Its optimizer state is keyed by position in the optimizer's param groups, which lmlab
        splits by weight decay; Lightning's loader re-keys it by the module's parameter order instead, so shapes
        mismatch (torch's RuntimeError). Re-keyed here by the optimizer's own order."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        module = self.model
        options = StateDictOptions(full_state_dict=True, strict=self.lightning_module.strict_loading)
        set_model_state_dict(module, checkpoint.pop("state_dict"), options=options)
        names = {p: n for n, p in module.named_parameters()}
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            order = [names[p] for g in optimizer.param_groups for p in g["params"]]  # position -> parameter name
            keyed = {"state": {order[i]: s for i, s in state["state"].items()},
                     "param_groups": [{**g, "params": [order[i] for i in g["params"]]} for g in state["param_groups"]]}
            set_optimizer_state_dict(module, optimizer, optim_state_dict=keyed, options=options)
        return checkpoint
