"""`lmlab branch <run> at=<step> decay=<steps> [out=<dir>] [overrides ...]`: a decay branch (WSD-S, OLMo-core's
cooldowns from one constant-LR trunk): a new run that continues the trunk from its step checkpoint at `at` (one of
`checkpoint.keep_last`'s, in the trunk's stable phase) and cools the learning rate down over `decay` steps, so one
trunk's compute yields several budget points (`eval.py compare=` and the ladder read each branch as a run).

The branch is a run directory of its own (default `<trunk>_branch_<at>+<decay>` beside the trunk): the trunk's saved
overrides (read as data), its checkpoint at `at` as the branch's last.ckpt and its metrics.csv (the rows from `at` on
are the branch's own once it logs), then `train` with `resume=true trainer.max_steps=<at + decay> schedule=wsd` and
the decay starting exactly at `at` from the trunk's own warmup and min_lr_ratio; `trunk.run` and `trunk.step` record
where it came from (summary.json's config). Its first step is the trunk's step `at`: the same weights, optimizer state,
batch and learning rate, so the same loss. Overrides after the arguments go to train as typed (e.g.
schedule.min_lr_ratio=0.1).
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

import yaml

USAGE = "lmlab branch <run dir> at=<step> decay=<steps> [out=<dir>] [train overrides ...]"


def _int(key: str, value: str | None) -> int:
    if value is None or not value.isdigit() or int(value) < 1:
        raise ValueError(f"{key}={value} must be a step count >= 1; usage: {USAGE}")
    return int(value)


def plan(trunk_dir: str | Path, at: int, decay: int, out: str | Path | None = None) -> tuple[Path, list[str]]:
    """Check the trunk and the step, lay out the branch directory; return it and train's overrides for it. Raises
    ValueError naming the key for anything that cannot branch."""
    from lmlab.record.rundir import METRICS, RunDir

    trunk = RunDir(trunk_dir)
    summary = trunk.read_summary() if trunk.path.is_dir() else None
    if summary is None or not isinstance(summary.get("config"), dict):
        raise ValueError(f"{trunk.path}: not a run directory with a summary.json (a run of train.py); usage: {USAGE}")
    cfg = summary["config"]
    schedule, max_steps = cfg.get("schedule") or {}, int(cfg["trainer"]["max_steps"])
    if schedule.get("name") not in ("wsd", "constant"):
        raise ValueError(f"{trunk.path} ran schedule={schedule.get('name')}: a branch cools down from a constant "
                         f"learning rate, a trunk with schedule=wsd or constant")
    warmup = int(schedule.get("warmup_steps") or 0)
    stable = max_steps - int(schedule.get("decay_frac", 0.0) * max_steps) if schedule["name"] == "wsd" else max_steps
    kept = dict(trunk.step_checkpoints())
    if at not in kept:
        raise ValueError(f"at={at}: {trunk.path} keeps step checkpoints at {sorted(kept) or 'no step'} "
                         f"(checkpoint.keep_last=k keeps the last k validations'); branch at one of them")
    if not warmup <= at < stable:
        raise ValueError(f"at={at} is not in the trunk's stable phase, steps {warmup}..{stable - 1} (after its "
                         f"warmup, before its own decay): the branch's first step would not be the trunk's")
    branch = Path(out) if out else trunk.path.parent / f"{trunk.path.name}_branch_{at}+{decay}"
    if RunDir(branch).holds_run():
        raise ValueError(f"out={branch} holds a run already; name another directory with out=")
    saved = trunk.read_overrides()  # data: refused naming the file and line
    if saved is None:
        raise ValueError(f"{trunk.path} has no saved command line (.hydra/overrides.yaml: a run of train.py or lmlab "
                         f"train; a trunk trained from Python has none), so its branch could not read its data "
                         f"and model again")
    (branch / ".hydra").mkdir(parents=True, exist_ok=True)
    (branch / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(list(saved)))
    if kept[at].is_dir():
        raise ValueError(f"at={at}: {kept[at]} is sharded (trainer=fsdp2); make it one file first: python -m "
                         f"lmlab.record.consolidate {trunk.path} {kept[at]}")
    (branch / "checkpoints").mkdir(exist_ok=True)
    _own_checkpoint(kept[at], RunDir(branch).last, f"at={at}")
    if (trunk.path / METRICS).is_file():
        shutil.copyfile(trunk.path / METRICS, branch / METRICS)  # the rows from `at` on: the branch's own, at resume
    frac = (decay + 0.5) / (at + decay)  # decay_start = max_steps - int(frac * max_steps) = at exactly
    quoted = str(trunk.path.resolve()).replace("\\", "\\\\").replace("'", "\\'")
    return branch, [f"hydra.run.dir={branch}", "resume=true", f"trainer.max_steps={at + decay}", "schedule=wsd",
                    f"schedule.warmup_steps={warmup}", f"schedule.decay_frac={frac!r}",
                    f"schedule.min_lr_ratio={schedule.get('min_lr_ratio', 0.0)!r}", f"trunk.run='{quoted}'",
                    f"trunk.step={at}"]


def _own_checkpoint(source: Path, last: Path, what: str) -> None:
    """The trunk's checkpoint as the branch's last.ckpt, its checkpoint callback's state the branch's own: its
    directory, its last checkpoint, and no best yet (the trunk's best.ckpt is neither read nor replaced by the
    branch's, which Lightning would do for a state naming another directory)."""
    import torch

    from lmlab.record.rundir import load_checkpoint

    ckpt = load_checkpoint(source, what)
    for name, state in (ckpt.get("callbacks") or {}).items():
        if name.startswith("ModelCheckpoint") and isinstance(state, dict):
            state.update(dirpath=str(last.parent.resolve()), last_model_path=str(last.resolve()),
                         best_model_path="", best_model_score=None, kth_best_model_path="", best_k_models={})
    torch.save(ckpt, last)


def run(prog: str, argv: Sequence[str]) -> None:
    args = list(argv)
    named = {a.partition("=")[0]: a.partition("=")[2] for a in args if a.partition("=")[0] in ("at", "decay", "out")}
    dirs = [a for a in args if "=" not in a and not a.startswith("-")]
    rest = [a for a in args if a not in dirs and a.partition("=")[0] not in named]
    try:
        if len(dirs) != 1:
            raise ValueError(f"name one trunk run directory; usage: {USAGE}")
        branch, overrides = plan(dirs[0], _int("at", named.get("at")), _int("decay", named.get("decay")),
                                 named.get("out"))
    except ValueError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    print(f"{prog}: {branch} continues {Path(dirs[0])} from step {named['at']}, cooling down over {named['decay']} "
          f"steps", file=sys.stderr)
    from lmlab.commands import train

    # the process is train from here (DDP's other ranks start as `python -m lmlab.commands.train <overrides>`)
    sys.modules["__main__"].__spec__ = train.__spec__
    sys.argv[0] = train.__file__
    try:
        train.run(prog, [*overrides, *rest])
    except SystemExit as stop:  # refused before its first step: no branch left behind (a started one keeps its files)
        if stop.code not in (0, None) and not (branch / "summary.json").exists():
            shutil.rmtree(branch, ignore_errors=True)
        raise
