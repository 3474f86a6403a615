"""Counting what would make a GPU wait for its queue, on the CPU: every call that reads a tensor's value to the host.

On a CPU nothing waits, so a sync costs nothing here and shows nowhere; on a GPU each one stalls the host until all
queued kernels are done. `HostSyncs` records them by two hooks at once:
- Python-level (a TorchFunctionMode): `.tolist()`, `.cpu()`, `.numpy()`, which on a CPU tensor never reach the
  dispatcher;
- operator-level (a TorchDispatchMode): `_local_scalar_dense` (what `.item()`, `float(t)`, `int(t)`, `bool(t)`, `if t:`
  call), and the operators whose output size depends on the data, which a GPU must read back to allocate: nonzero,
  bincount, unique, masked_select, boolean-mask indexing, repeat_interleave without output_size.
Each record names the operator and the innermost frame of lmlab's (or the caller's) code that made it.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

PYTHON_READS = {"tolist", "cpu", "numpy"}
DATA_SIZED = {"aten.nonzero.default", "aten.bincount.default", "aten.masked_select.default",
              "aten._unique2.default", "aten.unique_dim.default", "aten.unique_consecutive.default",
              "aten.repeat_interleave.Tensor"}


def _where() -> str:
    """The innermost frame in lmlab's or the tests' code (else the innermost outside torch): where to look."""
    frames = [f for f in traceback.extract_stack()[:-3] if "/torch/" not in f.filename]
    ours = [f for f in frames if "/lmlab/" in f.filename and "/tests/syncs.py" not in f.filename]
    f = (ours or frames or [None])[-1]
    return "?" if f is None else f"{f.filename.rsplit('/', 2)[-2:]}:{f.lineno} {f.name}"


@dataclass
class HostSyncs:
    """`with HostSyncs() as syncs: ...` -> syncs.calls, a list of (operator, where)."""

    calls: list[tuple[str, str]] = field(default_factory=list)

    def __enter__(self) -> HostSyncs:
        self._modes = [_Python(self.calls), _Dispatch(self.calls)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)


class _Python(TorchFunctionMode):
    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in PYTHON_READS:
            self.calls.append((func.__name__, _where()))
        return func(*args, **(kwargs or {}))


class _Dispatch(TorchDispatchMode):
    def __init__(self, calls: list) -> None:
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = str(func), kwargs or {}
        if (name == "aten._local_scalar_dense.default" or name in DATA_SIZED and kwargs.get("output_size") is None
                or name == "aten.index.Tensor" and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])):
            self.calls.append((name, _where()))
        return func(*args, **kwargs)
