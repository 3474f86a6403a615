"""Hostile pickles for the tests of every reader lmlab has: each payload creates the file `marker` when it runs.

Written opcode by opcode (the way an attacker writes them, not with `pickle.dumps` of a class) so that each
mechanism a restricted unpickler must refuse is covered: GLOBAL and STACK_GLOBAL lookups with REDUCE, INST, OBJ,
NEWOBJ + BUILD (`__setstate__` of an importable class), dotted names that walk attributes from an allowed module to
`operator.attrgetter`/`itemgetter`/`methodcaller` (which reach `os` through a function's `__globals__`), and a
payload placed in front of the genuine data so that a reader which runs it still returns normal results; and
writes into what the unpickler did not build (`STATE_WRITES`: BUILD on an allowed class, or on an enum member, which
set attributes for the whole process).
"""

from __future__ import annotations

import os
import pickle
import struct
from collections.abc import Callable
from pathlib import Path, PosixPath

_DCP_PLANNER = "torch.distributed.checkpoint.planner"  # imports `operator`: the reported chain starts here


def _str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b  # BINUNICODE


def _int(i: int) -> bytes:
    return b"J" + struct.pack("<i", i)  # BININT


def _global(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"  # GLOBAL


def _stack_global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + b"\x93"  # STACK_GLOBAL (protocol 4: dotted names are attribute walks)


class Trap:
    """An importable class whose `__setstate__` runs code: what BUILD calls."""

    def __setstate__(self, state: str) -> None:
        Path(state).touch()


def _open_call(marker: Path) -> bytes:  # builtins.open(marker, "w"): creates the file
    return _global("builtins", "open") + b"(" + _str(str(marker)) + _str("w") + b"tR"


def _os_system(marker: Path) -> bytes:
    return _stack_global("os", "system") + _str(f"touch '{marker}'") + b"\x85R"


def _inst(marker: Path) -> bytes:
    return b"(" + _str(str(marker)) + _str("w") + b"i" + b"builtins\nopen\n"


def _obj(marker: Path) -> bytes:
    return b"(" + _global("builtins", "open") + _str(str(marker)) + _str("w") + b"o"


def _newobj_build(marker: Path) -> bytes:
    return _global(__name__, "Trap") + b")\x81" + _str(str(marker)) + b"b"


def _operator_chain(marker: Path) -> bytes:
    """attrgetter('__init__.__globals__')(FileSystemReader)['os'].open(marker, O_CREAT|O_WRONLY), every global
    reached through a dotted name under torch.distributed.checkpoint."""
    reader = _stack_global("torch.distributed.checkpoint.filesystem", "FileSystemReader")
    getter = _stack_global(_DCP_PLANNER, "operator.attrgetter") + _str("__init__.__globals__") + b"\x85R"
    module_globals = getter + reader + b"\x85R"
    os_module = _stack_global(_DCP_PLANNER, "operator.itemgetter") + _str("os") + b"\x85R" + module_globals + b"\x85R"
    call = _stack_global(_DCP_PLANNER, "operator.methodcaller") + _str("open") + _str(str(marker)) + \
        _int(os.O_CREAT | os.O_WRONLY) + b"\x87R"
    return call + os_module + b"\x85R"


# name -> body (the ops that build the payload's value, without PROTO or STOP)
PAYLOADS: dict[str, Callable[[Path], bytes]] = {
    "global_reduce": _open_call,
    "stack_global_os_system": _os_system,
    "inst": _inst,
    "obj": _obj,
    "newobj_build": _newobj_build,
    "operator_chain": _operator_chain,
}


def hostile(name: str, marker: Path, genuine: bytes | None = None) -> bytes:
    """The payload `name` as a whole pickle; with `genuine` (a pickle), the payload runs first, its value is
    dropped (POP) and the genuine pickle follows: a reader that runs it returns the genuine value."""
    body = b"\x80\x04" + PAYLOADS[name](marker)
    if genuine is None:
        return body + b"."
    return body + b"0" + genuine


def hidden_in_tuple(marker: Path, genuine: object) -> bytes:
    """itemgetter(1)((payload, genuine)) through torch.distributed.checkpoint's `operator`: the payload runs inside
    the record and the reader gets the genuine object back."""
    inner = pickle.dumps(genuine, protocol=2)[2:-1]  # no PROTO, no STOP: the genuine record's ops
    pick = _stack_global(_DCP_PLANNER, "operator.itemgetter") + _int(1) + b"\x85R"
    return b"\x80\x04" + pick + b"(" + _operator_chain(marker) + inner + b"t\x85R."


_ENCODING = "torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"  # an allowed enum: calling it returns a member

# name -> (the object written into, its attribute, the payload's body): each BUILD sets the attribute to `builtins.set`
STATE_WRITES: dict[str, tuple[Callable[[], object], str, bytes]] = {
    "build_on_a_class": (lambda: PosixPath, "exists", _global("pathlib", "PosixPath") + b"N}" + _str("exists") +
                         _global("builtins", "set") + b"s\x86b"),  # setattr(PosixPath, "exists", set)
    "build_dict_on_an_enum_member": (lambda: _enum_member(), "_value_", _global(*_ENCODING) + b"(" + _int(0) +
                                     b"tR}" + _str("_value_") + _global("builtins", "set") + b"sb"),
}


def _enum_member() -> object:
    import importlib

    return getattr(importlib.import_module(_ENCODING[0]), _ENCODING[1])(0)


def state_write(name: str, genuine: bytes) -> bytes:
    """The write `name` in front of the genuine pickle (its value dropped): a reader that runs it returns normal data."""
    return b"\x80\x04" + STATE_WRITES[name][2] + b"0" + genuine
