"""Reading the sharded checkpoints `trainer=fsdp2` writes (torch.distributed.checkpoint, DCP: one shard file per
rank plus Lightning's `meta.pt`) without running code: what `lmlab.record.rundir.load_checkpoint` returns for one, what
eval and `init_from=` read, what `python -m lmlab.record.consolidate <run>` writes as one file, and how
`lmlab.run.distributed.FSDP2Strategy` loads its own checkpoint to resume.

- `read_sharded` gathers a DCP directory into one Lightning checkpoint dict on CPU in one process (no process group).

Safety: DCP's own reader unpickles its `.metadata` file and non-tensor entries (optimizer hyper-parameters) with
plain pickle, which can run code. lmlab reads both through `weights_only` rules instead: the metadata through an
unpickler that builds only DCP's metadata records and torch's size/dtype types and writes state only into objects it
built (never a class: pickle's BUILD on one sets its attributes for the whole process), every entry with
`torch.load(weights_only=True)`.
"""

from __future__ import annotations

import enum
import importlib
import io
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
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
        if metadata.storage_meta is None:  # a field with its default on Metadata: None in older checkpoints
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
