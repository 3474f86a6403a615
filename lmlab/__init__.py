"""lmlab: a config-driven laboratory for GPT-style architecture ablations.

    from lmlab import compose, build_model
    cfg = compose(["norm=rms", "ffn=swiglu", "position=rope"])
    model = build_model(cfg)          # model(idx) -> logits (B, T, vocab)
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig
    from torch import nn

from lmlab.registry import CONF_DIR  # noqa: E402  (the YAMLs: lmlab.CONF_DIR as before)


def _job_dirname(overrides: str, task: list[str] | None = None, sweep_dir: str | None = None) -> str:
    """A sweep job's directory name from its overrides (Hydra's override_dirname, which leaves out the resumable keys
    the command set once: lmlab.cli.dirname_exclusions): one path component, at most ~150 characters. A job that an
    earlier lmlab named by all its overrides (`task`, sorted, as Hydra joins them) keeps that directory when it holds a
    run and the new name does not exist: the same sweep command goes on continuing it."""
    import hashlib

    def name_of(overrides: str) -> str:
        name = overrides.replace("/", "_") or "default"
        return name if len(name) <= 150 else f"{name[:140]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"

    name = name_of(overrides)
    if task is not None and sweep_dir is not None:
        old = name_of(",".join(sorted(task)))
        if old != name and (Path(sweep_dir) / old / "summary.json").exists() and not (Path(sweep_dir) / name).exists():
            return old
    return name


def _sqlite_url(path: str) -> str:
    """An SQLite URL for `path` (conf/hparams_search: the Optuna study in the sweep directory), its directory made:
    the sweeper opens the study before Hydra creates the sweep directory, and SQLite doesn't create directories."""
    db = Path(path).expanduser().resolve()
    db.parent.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{db}"


def _study_seed(db: str, seed: int) -> int:
    """The sampler seed of an Optuna search (resolver `lmlab.study_seed`, conf/hparams_search/optuna.yaml): `seed`
    plus the trials its study already holds, so that a resumed search draws new random trials instead of the ones
    it began with (a trial that repeats an earlier one's parameters adds nothing). The study is read with sqlite3."""
    import sqlite3
    import time
    from contextlib import closing

    path = Path(db).expanduser()
    if not path.is_file():
        return seed
    deadline = time.monotonic() + STUDY_READ_S  # a crafted file (a `trials` view that never ends) cannot hang a start
    with closing(sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=STUDY_READ_S)) as con:
        con.set_progress_handler(lambda: time.monotonic() > deadline, 1000)
        try:
            if con.execute("SELECT type FROM sqlite_master WHERE name = 'trials'").fetchone() != ("table",):
                raise ValueError(f"{path}: its `trials` is not a table: not a study Optuna wrote")
            (count,) = con.execute("SELECT COUNT(*) FROM trials").fetchone()
        except sqlite3.DatabaseError:
            if time.monotonic() > deadline:
                raise ValueError(f"{path}: counting its trials took over {STUDY_READ_S} s: not a study Optuna "
                                 f"wrote") from None
            return seed  # not a study (yet): Optuna itself reports what is wrong with it
    return seed + int(count)


STUDY_READ_S = 10  # seconds a sweep's study database may take to read


def _slurm_count(key: str, value: object) -> int:
    """A launcher count from a trainer key (resolver `lmlab.slurm_count`, conf/hydra/launcher/slurm.yaml): SLURM
    needs the tasks and GPUs per node before the job starts, so `auto`, a list of device ids or 0 are refused."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}={value!r}: hydra/launcher=slurm needs a number >= 1 here (one SLURM task per GPU: "
                         f"--ntasks-per-node and --gpus-per-node are trainer.devices, --nodes is trainer.num_nodes); "
                         f"e.g. {key}=8")
    return value


GPU_ACCELERATORS = ("gpu", "cuda", "auto")  # auto: a GPU where the job runs; a CPU cluster sets accelerator=cpu
CPU_ACCELERATORS = ("cpu",)


def _slurm_by_accelerator(accelerator: object, on_gpu: object, on_cpu: object) -> object:
    """A launcher request that depends on the run's accelerator (resolver `lmlab.slurm_by_accelerator`,
    conf/hydra/launcher/slurm.yaml): `--gpus-per-node` only for a GPU run (on a cluster without GRES a CPU job that
    asks for GPUs is refused by sbatch; on a GPU cluster it would hold GPUs it never uses), and the CPU and memory
    requests of a GPU node or of a small CPU node."""
    name = str(accelerator).lower()
    if name in GPU_ACCELERATORS:
        return on_gpu
    if name in CPU_ACCELERATORS:
        return on_cpu
    raise ValueError(f"trainer.accelerator={accelerator!r}: hydra/launcher=slurm knows "
                     f"{list(GPU_ACCELERATORS + CPU_ACCELERATORS)} (GPU ones ask SLURM for trainer.devices GPUs per "
                     f"node); set hydra.launcher.gpus_per_node, cpus_per_task and mem_gb yourself for another one")


def _equal_flops_width(n_layer: int, ref_layers: int, ref_width: int, multiple: int = 8) -> int:
    from lmlab.run.budget import equal_flops_width

    return equal_flops_width(int(n_layer), int(ref_layers), int(ref_width), int(multiple))


def _step_at(fraction: float, max_steps: int) -> int:
    """`${lmlab.step_at:0.67,${trainer.max_steps}}`: the step at that fraction of the run (at least 1)."""
    return max(1, round(float(fraction) * int(max_steps)))


def _register_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, fn in (("lmlab.dirname", _job_dirname), ("lmlab.sqlite", _sqlite_url), ("lmlab.study_seed", _study_seed),
                     ("lmlab.slurm_count", _slurm_count), ("lmlab.slurm_by_accelerator", _slurm_by_accelerator),
                     ("lmlab.equal_flops_width", _equal_flops_width), ("lmlab.step_at", _step_at)):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


_register_resolvers()


# --- where the modules that once sat at the package root live now -------------------------------------------------
# One forwarding table: `import lmlab.rundir`, `python -m lmlab.consolidate`, an old run's saved config naming
# `_target_: lmlab.tensorboard.TensorBoardLogger` keep working, and each is the module in its wing (the same object,
# so a patch through either name is one patch). New code imports the wing's path.
_MOVED = {
    "muon": "optim", "lamb": "optim", "schedule_free": "optim", "cautious": "optim", "warmup": "optim",
    "loss": "model", "memory": "model",
    "rundir": "record", "saved": "record", "trusted": "record", "temporaries": "record", "summary": "record",
    "metrics_csv": "record", "tracking": "record", "tensorboard": "record", "targets": "record", "plots": "record",
    "tables": "record", "consolidate": "record",
    "plan": "run", "checks": "run", "lit": "run", "monitor": "run", "interrupt": "run", "early_signals": "run",
    "progress": "run", "distributed": "run", "training": "run", "jacobian": "run", "attn_entropy": "run",
    "perf": "run", "budget": "run",
    "evaluate": "analysis", "compare": "analysis", "compare_gaps": "analysis", "compare_stats": "analysis",
    "fits": "analysis", "ladder": "analysis", "significance": "analysis", "studies": "analysis",
    "generate": "analysis",
    "interop.harness": "analysis", "model.attention.mask": "model", "model.flex": "model.attention",
    "model.cache": "model.attention", "model.score": "model.attention",
    "model.attention.window": "model.attention.parts", "model.attention.xsa": "model.attention.parts",
    "model.attention.key_offset": "model.attention.parts", "model.attention.paired_heads": "model.attention.parts",
}


class _Forward(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`lmlab.<old>` is `lmlab.<wing>.<old>` (`_MOVED`): the module itself, and its code for `python -m lmlab.<old>`."""

    @staticmethod
    def _new(fullname: str) -> str | None:
        old = fullname.removeprefix("lmlab.")
        wing = _MOVED.get(old) if fullname.startswith("lmlab.") else None
        return f"lmlab.{wing}.{old.rpartition('.')[2]}" if wing else None

    def find_spec(self, fullname: str, path: object = None,
                  target: object = None) -> importlib.machinery.ModuleSpec | None:
        new = self._new(fullname)
        if not new:
            return None
        found = importlib.util.find_spec(new)  # its file as the alias's origin: `python -m lmlab.<old>`'s sys.argv[0]
        return importlib.util.spec_from_loader(fullname, self, origin=found.origin if found else None)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self._new(spec.name))
        spec.loader_state = module.__spec__  # importlib sets the module's __spec__ to this alias: exec_module undoes it
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Nothing to run (the module was imported under its own name); its own spec back."""
        module.__spec__ = module.__spec__.loader_state

    def get_code(self, fullname: str) -> types.CodeType | None:
        new = self._new(fullname)
        return importlib.util.find_spec(new).loader.get_code(new)


sys.meta_path.insert(0, _Forward())  # before the path finders: an old file left in a checkout is not read


def compose(overrides: list[str] | None = None, config_name: str = "train") -> DictConfig:
    """The config `train.py` would see for these command-line overrides (no Hydra CLI, no run dir)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))


def build_model(cfg: DictConfig, vocab_size: int | None = None, eod_id: int | None = None) -> nn.Module:
    """The GPT `train.py` would build for `cfg`. The vocabulary size comes from `vocab_size`, else
    `cfg.model.vocab_size`, else the configured tokenizer (which loads the corpus, cached after the first time);
    likewise the end-of-document token's id that attention.doc_mask finds documents by (`eod_id`)."""
    from lmlab.config import arch_config
    from lmlab.model.gpt import GPT, validate

    if vocab_size is None and cfg.model.get("vocab_size") is None:
        from omegaconf import OmegaConf

        from lmlab import env
        from lmlab.data import build_datamodule

        env.setup(cfg)
        data = build_datamodule(OmegaConf.to_container(cfg.data, resolve=True), seq_len=cfg.model.max_seq_len,
                                seed=cfg.seed)
        data.prepare_data()
        data.setup("fit")
        vocab_size, eod_id = data.vocab_size, data.eod_id if eod_id is None else eod_id
        from lmlab.model.head import fit_head, fit_vocabulary

        spec, reserved = fit_head(OmegaConf.to_container(cfg.head, resolve=True), data.labels,
                                  cfg.data.get("name"))  # [MASK]'s id past the tokenizer's; a labelled set's labels
        cfg = cfg.copy()
        cfg.head, vocab_size = spec, vocab_size + reserved
        arch = arch_config(cfg, vocab_size=vocab_size, eod_id=eod_id)
        arch.head = fit_vocabulary(arch.head, data.tokenizer, vocab_size, eod_id,
                                   cfg.data.get("name"))  # head=prefix's prefix table
        return GPT(validate(arch))
    return GPT(validate(arch_config(cfg, vocab_size=vocab_size, eod_id=eod_id)))


__all__ = ["compose", "build_model"]
