"""The installed command: `lmlab train|eval|generate|compare|bench ...` (also `python -m lmlab ...`).

Each command takes exactly the arguments of the checkout's script (`lmlab train norm=rms` is `python train.py
norm=rms`, Hydra's own flags included: `-m`, `hydra.run.dir=...`, `--cfg job`); `lmlab compare <sweep dir>` is
`python eval.py compare=<sweep dir>`. train.py, eval.py and generate.py are thin wrappers over the same functions.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

COMMANDS = {
    "train": "train one variant, or a sweep with -m (python train.py)",
    "eval": "evaluate a run: run=<run dir> (python eval.py)",
    "generate": "sample text from a run: run=<run dir> prompt=\"...\" (python generate.py)",
    "compare": "compare the runs of a sweep, or of several: lmlab compare <sweep dir> [<sweep dir> ...] "
               "(python eval.py compare=<dir>); lmlab compare --seeds-needed=<d>: the seeds a t test needs for an "
               "effect d (a difference over its sd), exactly",
    "sweep": "a sweep's jobs: lmlab sweep status <sweep dir> [--json|--watch], lmlab sweep resume <sweep dir>",
    "bench": "the benchmark: lmlab bench [...] (python -m lmlab.bench)",
    "branch": "a decay branch of a WSD trunk: lmlab branch <run dir> at=<step> decay=<steps> [out=<dir>] "
              "[overrides ...], a new run cooling down from the trunk's step checkpoint",
    "ledger": "a fixed-budget ledger (train.py ledger=<file>) best first, with the noise floor: lmlab ledger <file> "
              "[--json]",
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {what}" for name, what in COMMANDS.items()]
    return ("usage: lmlab <command> [overrides ...]\n\ncommands:\n" + "\n".join(lines)
            + "\n\n`lmlab <command> --help` shows the command's own options (Hydra's for train, eval, generate).")


def _seeds_needed(arg: str) -> None:
    """Print `lmlab compare --seeds-needed=<d>`'s answer (lmlab.analysis.significance.advice); exit code 2 when <d> is
    not an effect > 0."""
    from lmlab.analysis.significance import advice

    _, _, value = arg.partition("=")
    try:
        print(advice(float(value)))
    except ValueError as err:  # not a number, or not one > 0
        why = str(err) if "effect" in str(err) else f"the effect d={value!r} must be a number > 0"
        print(f"lmlab compare --seeds-needed=<d>: {why}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: Sequence[str] | None = None) -> None:
    """Dispatch to a command; its arguments are passed on as typed."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(usage())
        return
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"lmlab: unknown command {name!r}; the commands are {', '.join(COMMANDS)}\n\n{usage()}",
              file=sys.stderr)
        raise SystemExit(2)
    if name == "compare":  # lmlab compare A [B ...] [key=value ...]: the directories are compare='s
        if "--seeds-needed" in rest:  # `--seeds-needed 0.5` as `--seeds-needed=0.5`
            at = rest.index("--seeds-needed")
            rest = [*rest[:at], "=".join(rest[at:at + 2]), *rest[at + 2:]]
        if asked := [a for a in rest if a.startswith("--seeds-needed")]:  # the exact seed count for an effect d
            rest = [a for a in rest if a not in asked]
            _seeds_needed(asked[-1])
            if not rest:  # only the seed count was asked
                return
        dirs = [a for a in rest if "=" not in a and not a.startswith("-")]
        if not dirs and not any(a.startswith("compare=") for a in rest):
            print("lmlab compare: name the sweep or run directories to compare: lmlab compare <sweep dir> "
                  "[<sweep dir> ...] [baseline=... target=...]", file=sys.stderr)
            raise SystemExit(2)
        if dirs:
            quoted = ["'" + d.replace("\\", "\\\\").replace("'", "\\'") + "'" for d in dirs]  # Hydra's quoting
            rest = [f"compare={quoted[0]}" if len(dirs) == 1 else f"compare=[{','.join(quoted)}]",
                    *(a for a in rest if a not in dirs)]
        name = "eval"
    if name == "bench":
        sys.argv = ["lmlab bench", *rest]
        import runpy

        runpy.run_module("lmlab.bench", run_name="__main__")
        return
    import importlib

    module = importlib.import_module(f"lmlab.commands.{name}")
    # The process is this command from here on: Lightning's DDP launcher starts the other ranks as `python -m <the
    # main module> <sys.argv[1:]>` (or `python <sys.argv[0]> ...` without a module), which is now `python -m
    # lmlab.commands.train <the overrides>`, not the dispatcher without its command word.
    sys.modules["__main__"].__spec__ = module.__spec__
    sys.argv[0] = module.__file__
    module.run(f"lmlab {name}", rest)
