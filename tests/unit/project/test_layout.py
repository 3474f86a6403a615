"""The package's layout, read from the code's own imports (every import, function-local ones too): no circles between
modules or between rooms (a wing, a folder, a root module), the wings' rule (`record` never imports `run` or
`analysis`, `run` never imports `analysis`), at most 12 modules at the root, and the old root paths forwarded to the
wings by one table (`import lmlab.rundir`, `python -m lmlab.consolidate`, an old config's `_target_`)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

from tests.runs import ROOT

PACKAGE = ROOT / "lmlab"
WINGS = ("optim", "record", "run", "analysis")
NEVER = {"record": {"run", "analysis"}, "run": {"analysis"}, "optim": {"run", "record", "analysis"}}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return mods


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the lmlab modules it imports anywhere in its file (`from lmlab import names` is lmlab.names)."""

    def known(name: str) -> str:
        while name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                graph[mod] |= {known(a.name) for a in node.names if a.name.split(".")[0] == "lmlab"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[:len(package.split(".")) - node.level + 1], *filter(None, [base])])
                if base.split(".")[0] == "lmlab":
                    graph[mod] |= {known(f"{base}.{a.name}") for a in node.names}
        graph[mod].discard(mod)
    return graph


def _room(mod: str) -> str:
    parts = mod.split(".")
    return "lmlab" if len(parts) == 1 else parts[1]


def _circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of `graph` (a path that comes back to its start), None when there is none."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (found := visit(nxt, [*path, nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_no_module_imports_its_way_back_to_itself() -> None:
    assert _circle(_imports(_modules())) is None


def test_the_rooms_form_floors_no_room_imports_one_that_imports_it() -> None:
    rooms: dict[str, set[str]] = defaultdict(set)
    for mod, deps in _imports(_modules()).items():
        rooms[_room(mod)] |= {_room(d) for d in deps} - {_room(mod)}
    # the package's __init__ (the faces: compose, build_model) sits above what it imports; nothing below reads it
    lower = {room for room, deps in rooms.items() if "lmlab" not in deps}
    assert _circle({r: d - {"lmlab"} for r, d in rooms.items()}) is None
    assert {"record", "run", "optim", "model", "data", "cli", "registry", "names", "env", "config"} <= lower


@pytest.mark.parametrize("wing", sorted(NEVER))
def test_a_wing_never_imports_the_wings_above_it(wing: str) -> None:
    graph = _imports(_modules())
    wrong = sorted(f"{mod} -> {dep}" for mod, deps in graph.items() if _room(mod) == wing
                   for dep in deps if _room(dep) in NEVER[wing])
    assert wrong == []


def test_the_root_keeps_only_the_faces() -> None:
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= 12, root
    assert all((PACKAGE / w / "__init__.py").is_file() for w in WINGS)


def test_an_old_root_path_is_the_module_in_its_wing() -> None:
    import lmlab

    for old, wing in lmlab._MOVED.items():
        name = old.rpartition(".")[2]
        assert not (PACKAGE / f"{old.replace('.', '/')}.py").exists(), old  # moved, not copied
        moved = __import__(f"lmlab.{wing}.{name}", fromlist=["_"])
        forwarded = __import__(f"lmlab.{old}", fromlist=["_"])
        assert forwarded is moved and forwarded.__name__ == f"lmlab.{wing}.{name}"
        assert forwarded.__spec__.name == forwarded.__name__  # its own spec, not the alias's
    from lightning.pytorch.loggers import Logger
    from omegaconf import OmegaConf

    from lmlab.record.tensorboard import TensorBoardLogger
    from lmlab.record.trusted import build

    # what an old run's saved config names still builds, through the same guard as a new one
    node = OmegaConf.create({"_target_": "lmlab.tensorboard.TensorBoardLogger", "save_dir": "/nonexistent"})
    assert type(build(node, "logger", Logger)) is TensorBoardLogger
    with pytest.raises(ModuleNotFoundError):
        __import__("lmlab.no_such_module")
