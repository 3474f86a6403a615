"""The run directory: its layout, safe reading, atomic writing and the lock, in one place.

A run directory is a researcher's lab notebook, read weeks later, so every entry point (train, resume,
`init_from=`, eval, compare) goes through the rules here:
- checkpoints are loaded with `weights_only=True`: a file that would run code when unpickled is refused, and so is
  anything that is not a loadable lmlab checkpoint, always with its path and the reason;
- every file lmlab writes goes to a temporary name first and is renamed over the old one, so a crash never leaves
  a truncated file where a good one was;
- one process trains into a directory at a time (`RunLock`); a lock left by a dead process is taken over.

Layout:
    .hydra/{config,overrides,hydra}.yaml   the config of the latest start (written once the checks have passed)
    checkpoints/last.ckpt, best.ckpt       (+ Lightning's hpc_ckpt_N.ckpt when it saved one under SLURM); under
                                           trainer=fsdp2 directories of shards (lmlab.run.distributed)
    checkpoints/step_<N>.ckpt              with checkpoint.keep_last=k: the last k validations' (lmlab.run.keep_last),
                                           what eval.py merge=last:k averages (lmlab.record.merge)
    metrics.csv  summary.json  tokenizer.json  plots/  eval/
    wandb/                                 the W&B run's files; wandb/lmlab.json: its id, name, group, project
    .lmlab.lock                            while a process trains into the directory
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import pickle
import re
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from lmlab.env import is_rank_zero  # noqa: F401  (importable from here, as in earlier lmlab)
from lmlab.record.temporaries import MARK, temporary  # noqa: F401  (temporary: importable from here, as its writers use
                                                      # it)
from lmlab.record.temporaries import OURS as _OURS

CHECKPOINTS = "checkpoints"
LAST = "last.ckpt"
BEST = "best.ckpt"
STEP = re.compile(r"^step_(?P<step>\d+)\.ckpt$")  # checkpoint.keep_last's step_<N>.ckpt (lmlab.run.keep_last)
SUMMARY = "summary.json"
METRICS = "metrics.csv"
TOKENIZER = "tokenizer.json"
HYDRA = ".hydra"
WEIGHTS = ("live", "ema")  # what SavedRun.build, eval.py weights= evaluate: the weights, or the weight EMA (optim.ema)
LOCK = ".lmlab.lock"
HYDRA_FILES = ("config.yaml", "overrides.yaml", "hydra.yaml")
WANDB = "wandb"
WANDB_RUN = "lmlab.json"  # in wandb/: the W&B run of this directory, continued on resume (lmlab/record/tracking.py)
# The logger backends that write into the run directory, and the subfolder each writes (lmlab.record.tracking builds
# them)
LOGGER_DIRS = {"wandb": WANDB, "tensorboard": "tensorboard"}
# What `overwrite=true` clears: everything a run of lmlab writes (the lock and anything else are left alone).
RUN_FILES = (CHECKPOINTS, METRICS, SUMMARY, TOKENIZER, HYDRA, "plots", "eval", *LOGGER_DIRS.values(), "probe.json")


class CheckpointError(ValueError):
    """A file that is not a loadable lmlab checkpoint, refused with its path and the reason."""


class RunDirBusy(RuntimeError):
    """Another live process trains into this run directory."""


# --- writing ---

# lmlab's own temporaries (lmlab.record.temporaries: `.<name>.lmlab-<pid>.tmp`, `.old`) are what cleaning up removes.
# Names lmlab wrote before the marker (`.<name>.<pid>.tmp`), cleaned only for the files lmlab writes there.
_LEGACY = re.compile(r"^\.(?P<target>.+)\.\d+\.tmp$")


@contextlib.contextmanager
def atomic_open(path: str | Path) -> Iterator[BinaryIO]:
    """A file to write `path` through: a temporary beside it (`temporary(path)`, which `RunDir.clean_temporaries`
    removes when a kill leaves one), flushed to disk and renamed over `path` once the block ends without an error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temporary(path)
    try:
        with open(tmp, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except (OSError, RuntimeError) as err:  # torch's zip writer says "unexpected pos" when the disk is full
        if (isinstance(err, OSError) and err.errno == errno.ENOSPC) or _nearly_full(path.parent):
            raise DiskFull(errno.ENOSPC, f"no space left on the device of {path.parent} to write {path.name} "
                                         f"({type(err).__name__}: {str(err).splitlines()[0][:120]}); the previous "
                                         f"{path.name} is kept: free space there, or continue the run elsewhere "
                                         f"(copy the directory, hydra.run.dir=<copy>)") from err
        raise
    finally:
        tmp.unlink(missing_ok=True)  # an error: the old file stays, the temporary goes


class DiskFull(OSError):
    """A write that failed because its filesystem is full (named: directory, file, what to do); the CLI prints it as
    one line."""


def _nearly_full(directory: Path, margin: int = 1 << 20) -> bool:
    try:
        return shutil.disk_usage(directory).free < margin
    except OSError:
        return False


def atomic_write(path: str | Path, data: str | bytes) -> None:
    """Write `data` to a temporary file beside `path`, flush it to disk, then rename it over `path`."""
    with atomic_open(path) as f:
        f.write(data.encode() if isinstance(data, str) else data)


def remember(path: str | Path, data: str | bytes) -> bool:
    """`atomic_write` for a memo (a cache of something lmlab can compute again): a cache lmlab cannot write into, such
    as a read-only shared one, is used for reading and the memo is skipped. Returns whether it was written."""
    try:
        atomic_write(path, data)
    except OSError as err:
        logging.getLogger(__name__).debug(f"not remembered in {path} ({err})")
        return False
    return True


def strict_json(obj: Any) -> Any:
    """`obj` with every non-finite float replaced by None: JSON has no NaN or Infinity."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): strict_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [strict_json(v) for v in obj]
    return obj


def dumps(obj: Any) -> str:
    """Strict JSON (non-finite -> null); objects JSON doesn't know become their str()."""
    return json.dumps(strict_json(obj), indent=2, default=str, allow_nan=False) + "\n"


# --- reading ---

def load_checkpoint(path: str | Path, what: str, mmap: bool = False, weights: bool = True) -> dict[str, Any]:
    """A Lightning checkpoint of lmlab, loaded with `weights_only=True`; `what` names the key the path came from
    (`run=`, `init_from=`, `resume`) for the error. A sharded checkpoint (a directory, trainer=fsdp2) is gathered
    into the same dict; `weights=False` skips its shards (the metadata a resume checks; a file is mmapped anyway)."""
    import torch

    path = Path(path)
    if path.is_dir():  # a sharded checkpoint (trainer=fsdp2): DCP shards + Lightning's meta.pt
        return _load_sharded(path, what, weights=weights)
    if not path.is_file():
        raise CheckpointError(f"{what}: {path} does not exist")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{what}: {path} is empty (0 bytes): not a checkpoint")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0]
        raise CheckpointError(f"{what}: refused {path}: it holds objects that only an unsafe load would build, and "
                              f"lmlab loads checkpoints with weights_only=True ({reason})") from None
    except Exception as err:  # torch raises many kinds on a file that isn't one (RuntimeError, EOFError, KeyError...)
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(f"{what}: {path} is not a loadable checkpoint (truncated or another format?): "
                              f"{reason}") from None
    if not isinstance(state, dict) or "state_dict" not in state or \
            "model" not in (state.get("hyper_parameters") or {}):
        raise CheckpointError(f"{what}: {path} is not a checkpoint of lmlab (no state_dict and model config)")
    return state


def _load_sharded(path: Path, what: str, weights: bool) -> dict[str, Any]:
    """A sharded checkpoint directory as one checkpoint dict (lmlab.record.sharded.read_sharded, weights_only rules
    throughout); without `weights`, its metadata only (what a resume checks before Lightning loads the shards)."""
    from lmlab.record.sharded import is_sharded, read_sharded

    if not is_sharded(path):
        raise CheckpointError(f"{what}: {path} is a directory but not a sharded checkpoint (no meta.pt and "
                              f".metadata of torch.distributed.checkpoint)")
    try:
        state = read_sharded(path, weights=weights)
    except pickle.UnpicklingError as err:
        reason = str(err).strip().splitlines()[0]
        raise CheckpointError(f"{what}: refused {path}: it holds objects that only an unsafe load would build, and "
                              f"lmlab loads checkpoints with weights_only=True ({reason})") from None
    except Exception as err:
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise CheckpointError(f"{what}: {path} is not a loadable sharded checkpoint (truncated?): {reason}") from None
    if not isinstance(state, dict) or "model" not in (state.get("hyper_parameters") or {}) or (
            weights and "state_dict" not in state):
        raise CheckpointError(f"{what}: {path} is not a checkpoint of lmlab (no state_dict and model config)")
    return state


def model_config(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's model config, with the FFN width its weights have.

    Records saved since December 2026 hold their derived sizes (`lmlab.config.DERIVED`) and are returned as they are:
    the model is rebuilt with the width they declare (`lmlab.model.resolve` refuses options that disagree with it).
    Older records hold the config only; lmlab sized GLU FFNs by another rule before December 2026 (hidden_mult · 2/3
    rounded to multiple_of, not matched to the MLP within 1%), so for them the width is read from the weights when
    it differs from today's rule and pinned as `ffn.hidden`: such runs still load.
    """
    cfg = dict(state["hyper_parameters"]["model"])
    if isinstance(cfg.get("mixer"), dict) and cfg["mixer"].get("backend") not in (None, "auto"):
        cfg["mixer"] = {**cfg["mixer"], "backend": "auto"}  # rebuilt anywhere: its kernel where it runs, else PyTorch
    if cfg.get("ffn_hidden") is not None:
        return cfg
    ffn = dict(cfg.get("ffn") or {})
    import torch  # loaded already: the checkpoint's tensors

    proj = (state.get("state_dict") or {}).get("model.h.0.mlp.c_proj.weight")
    if ffn.get("hidden") is None and proj is not None and isinstance(proj, torch.Tensor) and proj.ndim == 2:
        from lmlab.config import GPTConfig
        from lmlab.model.resolve import resolve

        if resolve(GPTConfig(**cfg)).ffn_hidden != proj.shape[1]:
            cfg["ffn"] = {**ffn, "hidden": int(proj.shape[1])}
    return cfg


@dataclass
class SavedRun:
    """A run directory read back: the model config as saved, its weights, the step they are of, the run's composed
    config and its tokenizer. What evaluation, generation, export, the harness and `init_from=` build on."""

    path: Path
    model: dict[str, Any]  # the GPTConfig record (lmlab.config), widths as the weights have them (model_config)
    weights: dict[str, Any]  # the GPT's state dict (the Lightning module's `model.` prefix removed)
    step: int
    config: dict[str, Any]  # the composed config it ran with (summary.json's, or .hydra/config.yaml's)
    tokenizer: Path
    ema_weights: dict[str, Any] | None = None  # optim.ema > 0: the weight EMA by parameter name (lmlab.optim.ema)

    def build(self, weights: str = "live") -> Any:
        """The run's GPT with its weights, in eval mode: the live weights, or `weights="ema"` the weight EMA's
        parameters (optim.ema > 0) over the live buffers."""
        from lmlab.config import GPTConfig  # here, not at the top: reading records needs no torch model code
        from lmlab.model.gpt import GPT, validate

        if weights not in WEIGHTS:
            raise ValueError(f"weights={weights!r}: choose among {', '.join(WEIGHTS)}")
        if weights == "ema" and not self.ema_weights:
            raise ValueError(f"weights=ema: {self.path} has no weight EMA (it trained with optim.ema=0)")
        model = GPT(validate(GPTConfig(**self.model)))
        model.load_state_dict(self.weights)
        if weights == "ema":
            from lmlab.optim.ema import load_ema

            load_ema(model, self.ema_weights)
        return model.eval()


def load_run(run_dir: str | Path, what: str = "run") -> SavedRun:
    """Read a run directory back (its last checkpoint with weights_only=True); `what` names the key it came from."""
    run = RunDir(run_dir)
    if not run.path.is_dir():
        raise FileNotFoundError(f"{what}={run.path}: no such run directory")
    if not run.last.exists():
        raise FileNotFoundError(f"{what}={run.path}: no checkpoints/last.ckpt (is this a run directory of train.py?)")
    from lmlab.record.saved import check_config  # what the directory records is data (a `_target_` lmlab would build)

    state = load_checkpoint(run.last, f"{what}={run.path}")
    weights = {k.removeprefix("model."): v for k, v in state["state_dict"].items() if k.startswith("model.")}
    summary = run.read_summary()
    if isinstance(summary, dict) and summary.get("config"):  # the resolved config, written by every run
        config = check_config(summary["config"], run.summary)
    elif (run.path / HYDRA / "config.yaml").is_file():  # a run that is still going, or was killed
        from omegaconf import OmegaConf

        path = run.path / HYDRA / "config.yaml"
        config = check_config(OmegaConf.to_container(OmegaConf.load(path), resolve=False), path)
    else:  # a checkpoint alone (copied without its records): its weights and model config are all there is
        config = {}
    return SavedRun(path=run.path, model=model_config(state), weights=weights, step=int(state.get("global_step", 0)),
                    config=config, tokenizer=run.tokenizer, ema_weights=(state.get("lmlab") or {}).get("ema_weights"))


def load_model(run_dir: str | Path, what: str = "run", weights: str = "live") -> Any:
    """The GPT of a run directory, from its last checkpoint (loaded with weights_only=True), in eval mode: its live
    weights, or `weights="ema"` its weight EMA's (SavedRun.build)."""
    return load_run(run_dir, what).build(weights)


JSON_LIMIT = 256 << 20  # bytes of a JSON record read back (a summary with a long val_curve is some megabytes)


def read_json(path: Path) -> Any:
    """A JSON record of a run directory, read as data: refused naming the file when it is over JSON_LIMIT, not JSON,
    or nested past what the parser can walk (a crafted file of 100,000 brackets)."""
    size = path.stat().st_size
    if size > JSON_LIMIT:
        raise ValueError(f"{path}: {size:,} bytes, over the {JSON_LIMIT:,} of a record lmlab writes")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    except RecursionError:
        raise ValueError(f"{path} nests too deep: not a record lmlab writes") from None


class RunDir:
    """Paths and records of one run directory."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def last(self) -> Path:
        return self.path / CHECKPOINTS / LAST

    @property
    def summary(self) -> Path:
        return self.path / SUMMARY

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def tokenizer(self) -> Path:
        return self.path / TOKENIZER

    @property
    def wandb(self) -> Path:
        return self.path / WANDB

    def read_wandb_run(self) -> dict[str, Any] | None:
        """The W&B run this directory logs to (id, name, group, project), or None when it has none yet."""
        path = self.wandb / WANDB_RUN
        if not path.is_file():
            return None
        return read_json(path)

    def write_wandb_run(self, info: dict[str, Any]) -> None:
        atomic_write(self.wandb / WANDB_RUN, dumps(info))

    def checkpoint(self) -> Path | None:
        """The checkpoint a resume continues from: the newest of last.ckpt and Lightning's hpc_ckpt_N.ckpt (which
        Lightning's own SLURM handling writes into the run directory), or None."""
        found = [p for p in (self.last, *self.path.glob("hpc_ckpt_*.ckpt"), *(self.path / CHECKPOINTS).glob(
            "hpc_ckpt_*.ckpt")) if p.is_file() or p.is_dir()]  # a directory: sharded (trainer=fsdp2)
        return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None

    def step_checkpoints(self) -> list[tuple[int, Path]]:
        """checkpoint.keep_last's checkpoints, checkpoints/step_<N>.ckpt (files, or directories of shards), as
        (N, path), oldest first."""
        directory = self.path / CHECKPOINTS
        found = [(int(m["step"]), p) for p in directory.iterdir() if (m := STEP.match(p.name))] \
            if directory.is_dir() else []
        return sorted(found)

    def holds_run(self) -> bool:
        return any((self.path / name).exists() for name in (CHECKPOINTS, METRICS, SUMMARY))

    def read_summary(self) -> dict[str, Any] | None:
        if not self.summary.is_file():
            return None
        summary = read_json(self.summary)
        if not isinstance(summary, dict):  # every reader takes it as an object: refused here, once, with the path
            raise ValueError(f"{self.summary} holds a {type(summary).__name__}, not an object")
        return summary

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.summary, dumps(summary))

    def read_overrides(self, typed: Any = None) -> list[str] | None:
        """The command-line overrides of the latest start (.hydra/overrides.yaml), or None when it has none. Each is
        read as data (lmlab.record.saved: keys of lmlab's config, literal values); `typed`, a continuing command's own
        overrides, replace the saved lines of the keys they set, which are then neither read nor returned. Anything
        else raises SavedStateRefused naming the file and line."""
        path = self.path / HYDRA / "overrides.yaml"
        if not path.is_file():
            return None
        from lmlab.record.saved import read_overrides

        return read_overrides(path, typed)

    def saved_lines(self) -> list[str]:
        """The lines of .hydra/overrides.yaml as strings, to show and compare (not to apply: read_overrides); [] when
        there is none."""
        path = self.path / HYDRA / "overrides.yaml"
        if not path.is_file():
            return []
        from lmlab.record.saved import saved_lines

        return saved_lines(path)

    def write_config(self, config: Any, overrides: list[str], hydra: Any = None) -> None:
        """.hydra/: the composed config, the overrides and (from the CLI) Hydra's own config, as Hydra writes them.
        lmlab writes them itself, after every check has passed, so a refused start leaves the old ones in place."""
        from omegaconf import OmegaConf

        atomic_write(self.path / HYDRA / "config.yaml", OmegaConf.to_yaml(config))
        atomic_write(self.path / HYDRA / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(list(overrides))))
        if hydra is not None:
            atomic_write(self.path / HYDRA / "hydra.yaml", OmegaConf.to_yaml(OmegaConf.create({"hydra": hydra})))

    def clean_temporaries(self) -> list[Path]:
        """Remove the temporaries a process killed mid-write left beside their targets, and only those: lmlab's own
        names (`temporary()`: the marker and a pid), in the run directory, checkpoints/, .hydra/ and wandb/; call
        with the lock held. A user's `.notes.tmp` or `.project.old/` is never touched. A sharded checkpoint caught
        between its two renames (`.last.ckpt.lmlab-<pid>.old` and no `last.ckpt`) gets its old name back.

        Names from before the marker are cleaned where they cannot be anyone else's: `.<name>.<pid>.tmp` of a file
        lmlab writes there (summary.json, metrics.csv, tokenizer.json, a `.ckpt`), and in checkpoints/ a sharded
        checkpoint moved aside or half-written (`.<name>.ckpt.old` / `.<name>.ckpt.tmp` holding DCP's files)."""
        import shutil

        found = []
        for directory in (self.path, self.path / CHECKPOINTS, self.path / HYDRA, self.wandb):
            if not directory.is_dir():
                continue
            for path in sorted(directory.iterdir()):
                kind = _temporary_kind(path, directory.name == CHECKPOINTS)
                if kind == "old":
                    target = path.with_name(re.sub(rf"\.({MARK}-\d+\.)?old$", "", path.name[1:]))
                    if not target.exists():
                        os.replace(path, target)
                        continue
                if kind is not None:
                    found.append(path)
        for path in found:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        return found

    def clear(self) -> None:
        """Remove what an earlier run wrote (overwrite=true)."""
        import shutil

        for name in RUN_FILES:
            target = self.path / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()

    def state(self) -> str:
        """What the directory shows, for `compare`: the summary's status, `running` while a process holds the
        lock, `killed` when a run left metrics or checkpoints but no summary and no live holder."""
        summary = self.read_summary()
        if RunLock.holder(self.path) is not None:
            return "running"
        if summary is not None:
            return summary.get("status", "unknown")
        return "killed" if self.holds_run() else "empty"


def _temporary_kind(path: Path, in_checkpoints: bool) -> str | None:
    """"tmp" or "old" for a temporary lmlab wrote (RunDir.clean_temporaries), None for anything else."""
    if match := _OURS.match(path.name):
        return match["kind"]
    legacy = _LEGACY.match(path.name)
    if legacy and path.is_file() and (legacy["target"] in (SUMMARY, METRICS, TOKENIZER, WANDB_RUN, *HYDRA_FILES)
                                      or legacy["target"].endswith(".ckpt")):
        return "tmp"
    sharded = (path / "meta.pt").is_file() and (path / ".metadata").is_file()  # lmlab.record.sharded.is_sharded
    if in_checkpoints and sharded and re.fullmatch(r"\..+\.ckpt\.(tmp|old)", path.name):
        return path.name.rpartition(".")[2]
    return None


class RunLock:
    """An exclusive `flock` on `<run dir>/.lmlab.lock`, holding a line that names the holder. Also guards other
    directories lmlab writes once for many jobs (token shards: `wait=True`, the second job waits).

    The kernel drops a flock when its process dies, so a lock file left by a killed run is simply taken over. The
    file is removed on release; a process that locked a file which was removed meanwhile tries again.
    """

    def __init__(self, run_dir: str | Path, wait: bool = False) -> None:
        self.path = Path(run_dir) / LOCK
        self.wait = wait  # False: a held lock is refused at once (RunDirBusy); True: wait for the holder to let go
        self._fd: int | None = None
        self.stale: str | None = None  # after acquire: the line of a holder that was killed holding it (or None)

    def acquire(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self.holder(self.path.parent) or "another process"
                if not self.wait:
                    os.close(fd)
                    raise RunDirBusy(f"{self.path.parent} is in use: {holder} trains into it. Wait for it to end, or "
                                     f"choose another directory (hydra.run.dir=...)") from None
                logging.getLogger(__name__).warning(f"waiting for {holder}, which holds {self.path.parent}")
                fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the holder removed the file between our open and our lock: take the new one
        info = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')} " \
               f"({' '.join(map(str, sys.argv))[:300]})"
        # a line left in the file: its holder died holding the lock (a release removes the file), killed mid-run
        self.stale = os.pread(fd, 4096, 0).decode(errors="replace").strip() or None
        os.ftruncate(fd, 0)
        os.write(fd, info.encode())
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    @staticmethod
    def holder(run_dir: str | Path) -> str | None:
        """Who holds the lock of `run_dir` now (None: nobody alive)."""
        path = Path(run_dir) / LOCK
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.read(fd, 4096).decode(errors="replace").strip() or "a live process"
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
        finally:
            os.close(fd)


def atomic_checkpoint_io() -> Any:
    """Lightning's checkpoint writer, renaming a finished temporary file over the old checkpoint: Lightning's own
    truncates the file and then writes it, so a crash mid-save would lose the last good checkpoint."""
    import torch
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    class AtomicCheckpointIO(TorchCheckpointIO):
        def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
            # Beside the target, not in $TMPDIR (Lightning's _atomic_save stages through fsspec's temporary file
            # there, which a kill mid-save leaks).
            with atomic_open(path) as f:
                torch.save(checkpoint, f)

    return AtomicCheckpointIO()
