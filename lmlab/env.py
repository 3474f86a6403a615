"""The process environment, in one place: the Hugging Face hub offline, torch's threads, glibc's malloc, lmlab's
warning filters, and which rank this process is. Every entry point (train.py, eval.py, generate.py, the bench,
`build_model`) sets it up through `setup`; W&B's mode is `lmlab.record.tracking`'s."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any


def offline() -> None:
    """The Hugging Face hub and datasets offline unless the user said otherwise (they read these once, at import:
    call before importing them)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")


def set_threads(threads: int | None) -> None:
    """torch's intra-op threads (None: torch's default, every core)."""
    if threads:
        import torch

        torch.set_num_threads(int(threads))


def filter_warnings() -> None:
    """The warnings that do not apply to an lmlab run, not printed (before the checks: they emit some)."""
    warnings.filterwarnings("ignore", message=".*(LeafSpec|litlogger|weights_only|does not have many workers).*")
    # Lightning's hint on a machine with srun on PATH (a SLURM login node) for a run that is not a SLURM job: lmlab's
    # own launch check (training.check_launch) says what applies
    warnings.filterwarnings("ignore", message=".*`srun` command is available on your system but is not used.*")
    # LitGPT.training_step returns None on purpose: a diverged step's update is skipped and the run stops there
    warnings.filterwarnings("ignore", message=".*`training_step` returned `None`.*")


def plain_warnings(prog: str) -> None:
    """lmlab's own warnings (a setting that does nothing, a run that is all warmup) as one line each on stderr,
    `lmlab train: warning: <what>`, not Python's `file:line: UserWarning` with a source line under it; any other
    package's warnings as Python prints them."""
    import sys

    shown, said = warnings.showwarning, set()
    root = os.path.dirname(os.path.abspath(__file__)) + os.sep

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if not str(filename).startswith(root) or not issubclass(category, UserWarning):
            return shown(message, category, filename, lineno, file, line)
        if str(message) not in said:  # once (the config is checked before the run and again as it starts)
            said.add(str(message))
            print(f"{prog}: warning: {message}", file=file or sys.stderr)

    warnings.showwarning = show


def child_python(code: str) -> list[str]:
    """The command of a child interpreter that runs `code` isolated from the working directory and the environment's
    PYTHONPATH (`-I`), with an explicit sys.path: this lmlab's root first, then the parent's own entries. So a
    directory lmlab is run from (a shared run or sweep directory) cannot plant a package the child imports."""
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])  # this lmlab, installed or not
    paths = [root, *(p for p in sys.path if p not in ("", ".", root))]
    return [sys.executable, "-I", "-c", f"import sys; sys.path[:0] = {paths!r}; {code}"]


def quick_exit() -> None:
    """End this process without the garbage collector's walks over every object torch and Lightning hold: at exit,
    after the atexit handlers registered later (W&B's, the run's own) and before the interpreter's teardown, the
    garbage is collected once (its finalizers run) and what is left is frozen (`gc.freeze`). The teardown walked them
    again after the command had finished (its files written, its processes joined): from a 1-step train.py's last
    line to its end took 1.5-2.0 s, 0.5 s now; a refusal's 1.0-1.2 s, 0.3 s now. Objects alive at exit were never
    promised their finalizers (the language reference, `object.__del__`). Once per process."""
    import atexit
    import gc

    if not _QUICK_EXIT:
        _QUICK_EXIT.append(atexit.register(lambda: (gc.collect(), gc.freeze())))


_QUICK_EXIT: list = []


def setup(cfg: Mapping[str, Any]) -> None:
    """A run's environment from its config: offline, lmlab's warning filters, `threads`, `malloc`; a quick exit."""
    quick_exit()
    offline()
    filter_warnings()
    set_threads(cfg.get("threads"))
    if cfg.get("malloc") == "keep":
        keep_freed_memory()


def keep_freed_memory() -> None:
    """Ask glibc to keep freed memory in the process: no mmap for big blocks, no trimming of the heap's top.

    By default glibc returns big blocks (and the heap's free top) to the OS on free, so each CPU training step
    page-faults its largest activations back in: ~40k faults per step at the benchmark's default size, a few % of
    a step. The process keeps its high-water mark instead. Nothing happens without glibc.
    """
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_top_pad, m_mmap_max = -1, -2, -4
    for option, value in ((m_trim_threshold, 2**31 - 1), (m_mmap_max, 0), (m_top_pad, 64 << 20)):
        libc.mallopt(option, value)


def is_rank_zero() -> bool:
    """Whether this process is the job's global rank 0, from the launchers' environment (torchrun, SLURM,
    Lightning's own DDP launcher); works before any Trainer exists."""
    return all(os.environ.get(k, "0") == "0" for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID"))
