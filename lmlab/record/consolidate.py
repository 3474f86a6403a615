"""`python -m lmlab.record.consolidate <run dir | sharded checkpoint dir> [out]`: a trainer=fsdp2 checkpoint as one
file.

The run's `checkpoints/last.ckpt/` (one shard per rank, torch.distributed.checkpoint) is gathered on CPU in this one
process (no GPU, no process group) into the checkpoint a one-process run writes: full weights, the optimizer state
keyed as torch's optimizers key it, the loops, lmlab's own state. It goes to `checkpoints/last.consolidated.ckpt`
(or `out`); the sharded directory is left as it is, so the run still resumes from it. eval.py `run=`, `export=hf`
and `init_from=` read the sharded checkpoint themselves; the single file is for copying elsewhere or loading with
plain `torch.load`. With `out` the sharded checkpoint itself (`<run>/checkpoints/last.ckpt`), the file replaces the
directory: the run then continues with any trainer (ddp, cpu, fsdp2), as a run that never was sharded. Any other
existing directory as `out` is refused: consolidate never deletes what it did not write.
The run directory is locked meanwhile (a run training into it is refused)."""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
from pathlib import Path

from lmlab.record.sharded import is_sharded
from lmlab.record.rundir import BEST, CHECKPOINTS, LAST, RunLock, load_checkpoint, temporary

CONSOLIDATED = "last.consolidated.ckpt"


def consolidate(source: str | Path, out: str | Path | None = None, overwrite: bool = False) -> Path:
    """Write the sharded checkpoint `source` (a run directory: its last.ckpt; or a checkpoint directory) to `out`
    as one file, atomically; return `out`. An existing file named as `out` is refused unless `overwrite` (the
    default name beside the checkpoint is lmlab's own: consolidating again replaces it)."""
    import torch

    source = Path(source)
    ckpt = source / CHECKPOINTS / LAST if (source / CHECKPOINTS).is_dir() else source
    if not is_sharded(ckpt):
        raise ValueError(f"{ckpt} is not a sharded checkpoint (a directory with meta.pt and .metadata, written by "
                         f"trainer=fsdp2); a single-file checkpoint needs no consolidation")
    named = out is not None
    out = Path(out) if out is not None else ckpt.parent / (CONSOLIDATED if ckpt.name == LAST else
                                                            f"{ckpt.name.removesuffix('.ckpt')}.consolidated.ckpt")
    if named and not overwrite and (out.is_file() or out.is_symlink()):  # never replace what lmlab did not write
        raise ValueError(f"out={out} exists; name another file, remove it, or pass --overwrite to replace it")
    in_place = out.is_dir() and out.resolve() == ckpt.resolve()
    if out.is_dir() and not in_place:  # never delete what lmlab did not write
        raise ValueError(f"out={out} is an existing directory, not the sharded checkpoint being consolidated "
                         f"({ckpt}); name a file to write (e.g. {out / CONSOLIDATED}), or {ckpt} itself to replace "
                         f"the shards by the one file")
    with RunLock(ckpt.parent.parent) if ckpt.parent.name == CHECKPOINTS else contextlib.nullcontext():
        state = load_checkpoint(ckpt, f"consolidate {source}")  # weights_only rules, the full state
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = temporary(out)  # lmlab's marker and pid: RunDir.clean_temporaries removes it after a kill
        torch.save(state, tmp)  # then renamed over `out`: a crash never leaves half a file under its name
        if in_place:  # `out` is the sharded checkpoint itself: the one file takes its place
            old = temporary(out, "old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(out, old)
            os.replace(tmp, out)
            shutil.rmtree(old)
        else:
            os.replace(tmp, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m lmlab.record.consolidate", description=__doc__.splitlines()[0])
    parser.add_argument("source", help=f"a run directory (its {CHECKPOINTS}/{LAST}) or a sharded checkpoint "
                                       f"directory ({LAST}, {BEST})")
    parser.add_argument("out", nargs="?", help=f"the file to write (default: {CHECKPOINTS}/{CONSOLIDATED} beside it)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing file named as out")
    args = parser.parse_args(argv)
    try:
        print(f"-> {consolidate(args.source, args.out, args.overwrite)}")
    except (ValueError, RuntimeError) as err:  # not sharded, not loadable, or a run trains into the directory
        raise SystemExit(str(err)) from None


if __name__ == "__main__":
    main()
