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
- `read_sharded` gathers a DCP directory into one Lightning checkpoint dict on CPU in one process (no process
  group): what `lmlab.rundir.load_checkpoint` returns for a sharded checkpoint, what eval and `init_from=` read, and
  what `python -m lmlab.consolidate <run>` writes as one file.

Safety: DCP's own reader unpickles its `.metadata` file and non-tensor entries (optimizer hyper-parameters) with
plain pickle, which can run code. lmlab reads both through `weights_only` rules instead: the metadata through an
unpickler that builds only DCP's metadata records and torch's size/dtype types and writes state only into objects it
built (never a class: pickle's BUILD on one sets its attributes for the whole process), every entry with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import io
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

META = "meta.pt"  # Lightning's file of everything but the weights and optimizer states, in a sharded checkpoint


def is_sharded(path: str | Path) -> bool:
    """Whether `path` is a sharded (DCP) checkpoint directory written by FSDP2Strategy."""
    path = Path(path)
    return path.is_dir() and (path / META).is_file() and (path / ".metadata").is_file()


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
        from lmlab.temporaries import temporary

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
        if not is_sharded(path):  # one file: consolidated in place (python -m lmlab.consolidate), or another trainer's
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


# --- reading DCP directories without running code ----------------------------------------------------------------

# Every global a `.metadata` that DCP writes refers to (read off torch 2.13's own pickles), by exact module and name.
# Nothing else is looked up: no dotted names (`planner.operator.methodcaller` walks attributes to any callable), no
# module attributes that merely live under torch.distributed.checkpoint, no functions but torch's layout lookup.
_DCP = "torch.distributed.checkpoint"
_METADATA_GLOBALS = frozenset({
    (f"{_DCP}.metadata", "Metadata"), (f"{_DCP}.metadata", "MetadataIndex"), (f"{_DCP}.metadata", "StorageMeta"),
    (f"{_DCP}.metadata", "TensorStorageMetadata"), (f"{_DCP}.metadata", "BytesStorageMetadata"),
    (f"{_DCP}.metadata", "ChunkStorageMetadata"), (f"{_DCP}.metadata", "TensorProperties"),
    (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"), (f"{_DCP}.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
})
_DTYPES = frozenset(name for name, value in vars(torch).items() if isinstance(value, torch.dtype))


# What an allowed class builds when it is called (REDUCE, OBJ, INST) or its `__new__` is (NEWOBJ): a new object,
# the only kind the metadata may then write into. Enums are left out: calling one returns an existing member.
_CONSTRUCTED = frozenset(c for c in (getattr(importlib.import_module(m), n) for m, n in _METADATA_GLOBALS)
                         if isinstance(c, type) and not issubclass(c, enum.Enum)) | {dict, list}


def _made_by(op: bytes, callee: Callable[[Any], Any] | None = None) -> Callable[[Any], None]:
    """Pickle's own handler for `op`, then the object it pushed recorded as built by this load when it is a new
    object (`callee(self)`, read before the handler runs: the class or callable it calls, which must be its type)."""
    load = pickle._Unpickler.dispatch[op[0]]

    def handler(self: _MetadataUnpickler) -> None:
        cls = callee(self) if callee is not None else None
        load(self)
        made = self.stack[-1]
        if type(made) in _CONSTRUCTED and (callee is None or type(made) is cls):
            self._made[id(made)] = made  # kept alive: an id is never reused during the load
    return handler


def _writes_into(op: bytes, target: Callable[[Any], Any]) -> Callable[[Any], None]:
    """Pickle's own handler for `op` (BUILD, SETITEM(S), APPEND(S), ADDITEMS), run only when the object it writes
    into (`target(self)`) was built by this load: never a class, a module-level object or an enum member."""
    load, name = pickle._Unpickler.dispatch[op[0]], _OP_NAMES[op]

    def handler(self: _MetadataUnpickler) -> None:
        try:
            obj = target(self)
        except IndexError:
            raise pickle.UnpicklingError(f"{name} with nothing to write into") from None
        if id(obj) not in self._made:
            what = f"the class {obj.__module__}.{obj.__qualname__}" if isinstance(obj, type) else \
                f"a {type(obj).__qualname__} it did not build"
            raise pickle.UnpicklingError(f"{name} on {what} is not allowed in a checkpoint's metadata")
        load(self)
    return handler


_OP_NAMES = {pickle.BUILD: "BUILD", pickle.SETITEM: "SETITEM", pickle.SETITEMS: "SETITEMS", pickle.APPEND: "APPEND",
             pickle.APPENDS: "APPENDS", pickle.ADDITEMS: "ADDITEMS"}


class _MetadataUnpickler(pickle._Unpickler):
    """Builds only DCP's metadata records, torch's sizes, dtypes and layouts, paths and plain containers: what DCP's
    `.metadata` holds, and nothing that runs code. Each global is resolved by its exact (module, name) pair, and an
    allowed class is a constructor only: state is written (BUILD, SETITEM, APPEND, ...) into objects this load built,
    never into a class or any object that existed before (pickle's BUILD on a class sets its attributes for the whole
    process). Python's unpickler, not C's: its opcodes can be checked one by one (the file is a few kB per layer)."""

    dispatch = dict(pickle._Unpickler.dispatch)
    for _op in (pickle.EMPTY_DICT, pickle.DICT, pickle.EMPTY_LIST, pickle.LIST, pickle.EMPTY_SET):
        dispatch[_op[0]] = _made_by(_op)
    dispatch[pickle.NEWOBJ[0]] = _made_by(pickle.NEWOBJ, lambda self: self.stack[-2])
    dispatch[pickle.NEWOBJ_EX[0]] = _made_by(pickle.NEWOBJ_EX, lambda self: self.stack[-3])
    dispatch[pickle.REDUCE[0]] = _made_by(pickle.REDUCE, lambda self: self.stack[-2])
    dispatch[pickle.OBJ[0]] = _made_by(pickle.OBJ, lambda self: self.stack[0])
    dispatch[pickle.INST[0]] = _made_by(pickle.INST)
    dispatch[pickle.BUILD[0]] = _writes_into(pickle.BUILD, lambda self: self.stack[-2])
    dispatch[pickle.SETITEM[0]] = _writes_into(pickle.SETITEM, lambda self: self.stack[-3])
    dispatch[pickle.APPEND[0]] = _writes_into(pickle.APPEND, lambda self: self.stack[-2])
    for _op in (pickle.SETITEMS, pickle.APPENDS, pickle.ADDITEMS):  # after a MARK: the object below it
        dispatch[_op[0]] = _writes_into(_op, lambda self: self.metastack[-1][-1])
    del _op

    def __init__(self, file: Any) -> None:
        super().__init__(file)
        self._made: dict[int, Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a checkpoint's metadata")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("a persistent id is not allowed in a checkpoint's metadata")


def read_metadata(path: str | Path) -> Any:
    """A DCP `.metadata` file through `_MetadataUnpickler`, checked to be the record DCP writes: one `Metadata` whose
    storage entries name shard files inside the checkpoint directory with no transforms (lmlab writes none)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    with open(path, "rb") as f:
        metadata = _MetadataUnpickler(f).load()
        if f.read(1):  # a second pickle after the first: not what DCP writes
            raise pickle.UnpicklingError("data after the metadata record")
    if type(metadata) is not Metadata:
        raise pickle.UnpicklingError(f"the file holds a {type(metadata).__name__}, not DCP's Metadata")
    for index, info in (metadata.storage_data or {}).items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            raise pickle.UnpicklingError("a storage entry that is not DCP's (MetadataIndex -> _StorageInfo)")
        name = info.relative_path
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise pickle.UnpicklingError(f"a storage entry outside the checkpoint directory ({name!r})")
        if info.transform_descriptors:
            raise pickle.UnpicklingError(f"a storage entry with transforms ({info.transform_descriptors!r})")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file reader with the `.metadata` file unpickled by `_MetadataUnpickler`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        metadata = read_metadata(self._get_metadata_path(kwargs.get("rank")))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def _load_bytes_safely(self, read_item: Any, value: io.BytesIO) -> None:
    """DefaultLoadPlanner.load_bytes with weights_only=True: non-tensor entries (optimizer hyper-parameters)."""
    obj = torch.load(value, weights_only=True)
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
    else:
        self.state_dict[read_item.dest_index.fqn] = obj


class SafeLoadPlanner(DefaultLoadPlanner):
    load_bytes = _load_bytes_safely


class SafeEmptyLoadPlanner(_EmptyStateDictLoadPlanner):
    """Loads every entry of the checkpoint into an empty dict (full tensors, one process)."""

    load_bytes = _load_bytes_safely


def read_sharded(path: str | Path, weights: bool = True) -> dict[str, Any]:
    """A sharded checkpoint as one Lightning checkpoint dict on CPU (weights_only throughout): its `meta.pt` plus,
    with `weights`, `state_dict` (full tensors) and `optimizer_states` keyed as a single-process optimizer's (by
    position), so the dict is the checkpoint a one-file run would have written."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    path = Path(path)
    SafeReader(path).read_metadata()  # a refused .metadata raises UnpicklingError here, not wrapped by DCP's loader
    checkpoint = torch.load(path / META, map_location="cpu", weights_only=True)
    if not weights:
        return checkpoint
    shards: dict[str, Any] = {}
    try:
        _load_state_dict(shards, storage_reader=SafeReader(path), planner=SafeEmptyLoadPlanner(), no_dist=True)
    except CheckpointException as err:  # a BaseException wrapping each rank's error: raise this process's own
        raise next(iter(err.failures.values()))[0] from None
    checkpoint["state_dict"] = shards.pop("state_dict")
    optimizers = sorted((k for k in shards if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint["optimizer_states"] = [_keyed_by_position(shards[k]) for k in optimizers]
    return checkpoint


def _keyed_by_position(state: dict[str, Any]) -> dict[str, Any]:
    """DCP keys optimizer state by parameter name; torch's `Optimizer.load_state_dict` by the parameters' order
    in the param groups."""
    ids = {name: i for i, name in enumerate(n for g in state["param_groups"] for n in g["params"])}
    return {"state": {ids[name]: s for name, s in state["state"].items()},
            "param_groups": [{**g, "params": [ids[n] for n in g["params"]]} for g in state["param_groups"]]}
