"""One training run, from a composed config to a run directory.

Order matters: every check that can fail on bad input runs before data is loaded or a step is taken; once
training starts, whatever happens (completion, divergence, Ctrl-C, an exception) ends with a summary.json.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lmlab.config import COMPUTE_KEYS, arch_config
from lmlab.summary import write_summary


def wandb_offline_by_default() -> None:
    """W&B runs offline unless the user opted in (WANDB_MODE or an API key)."""
    if "WANDB_MODE" not in os.environ and "WANDB_API_KEY" not in os.environ:
        os.environ["WANDB_MODE"] = "offline"


def setup_env(cfg: DictConfig) -> None:
    """Offline by default: W&B logs to the run dir unless the user opted in; the HF hub is never reached."""
    wandb_offline_by_default()
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore", message=".*(LeafSpec|litlogger|weights_only|does not have many workers).*")
    if cfg.get("threads"):
        import torch

        torch.set_num_threads(int(cfg.threads))
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


def check_config(cfg: DictConfig) -> None:
    """Everything that can be checked without data: architecture (on the meta device), optimizer, schedule."""
    from lmlab.lit import validate_optim

    arch_config(cfg, vocab_size=cfg.model.vocab_size or 256).validate()
    validate_optim(OmegaConf.to_container(cfg.optim), OmegaConf.to_container(cfg.schedule))
    if cfg.get("malloc", "system") not in ("system", "keep"):
        raise ValueError(f"malloc must be one of ['system', 'keep'] (got malloc={cfg.malloc!r})")
    if cfg.trainer.max_steps is None or cfg.trainer.max_steps < 1:
        raise ValueError(f"trainer.max_steps must be a positive integer (got {cfg.trainer.max_steps})")


def build_loggers(cfg: DictConfig, run_dir: Path, run_name: str, group: str, resume_step: int | None) -> list:
    from hydra.utils import instantiate

    from lmlab.metrics_csv import MetricsCSV

    loggers = [MetricsCSV(run_dir, resume_step)]  # run_dir/metrics.csv, always
    for key, spec in (cfg.logger or {}).items():
        extra: dict[str, Any] = {}
        if spec._target_.endswith("WandbLogger"):
            extra = {"save_dir": str(run_dir), "name": run_name, "group": group,
                     "offline": os.environ.get("WANDB_MODE", "offline") != "online"}
        elif spec._target_.endswith("TensorBoardLogger"):
            extra = {"save_dir": str(run_dir), "name": "tensorboard", "version": ""}
        loggers.append(instantiate(spec, **{k: v for k, v in extra.items() if spec.get(k) is None}))
    return loggers


# Keys of the model config that may differ between a run and one initialised from it (`init_from=`).
EXTENSIBLE = ("max_seq_len", "train_len", "rope_scaling", "dropout", "attention", *COMPUTE_KEYS)


def prepare_init_from(cfg: DictConfig) -> dict[str, Any] | None:
    """For `init_from=<run dir>`: use the source run's tokenizer, and scale RoPE relative to the length the
    source was trained at. Returns the source's model config and weights (None without init_from)."""
    if not cfg.get("init_from"):
        return None
    from lmlab.evaluate import load_run

    source = Path(cfg.init_from)
    model_cfg, weights, _ = load_run(source)
    if cfg.data.tokenizer in ("char", "bpe"):  # the vocabulary must be the source's, token for token
        cfg.data.tokenizer = str(source / "tokenizer.json")
    if cfg.rope_scaling.name != "none" and cfg.rope_scaling.get("original_max_len") is None:
        cfg.rope_scaling.original_max_len = model_cfg.get("train_len") or model_cfg["max_seq_len"]
    return {"model": model_cfg, "weights": weights, "path": str(source)}


def check_same_arch(what: str, new: dict[str, Any], saved: dict[str, Any], may_differ: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint whose architecture differs from the config, naming every differing key."""
    differ = sorted(k for k in new if k not in may_differ and new[k] != saved.get(k))
    if differ:
        detail = ", ".join(f"model/{k}: checkpoint has {saved.get(k)!r}, config has {new[k]!r}" for k in differ)
        raise ValueError(f"{what}: the checkpoint's architecture doesn't match the config ({detail})")


def load_init_from(model, new: dict[str, Any], source: dict[str, Any]) -> None:
    """Copy the source run's weights into `model`, refusing when the architectures differ."""
    check_same_arch(f"init_from={source['path']}", new, source["model"], EXTENSIBLE)
    try:
        model.load_state_dict(source["weights"])
    except RuntimeError as err:  # a learned position table of another length, typically
        raise ValueError(f"init_from={source['path']}: weights don't fit the config ({str(err).splitlines()[-1]}); "
                         f"position=learned cannot change model.max_seq_len") from None


def train(cfg: DictConfig, run_dir: str | Path, overrides: list[str] | None = None, group: str = "default",
          callbacks: list | None = None) -> dict[str, Any]:
    """Train as `cfg` says, writing everything into `run_dir`; return the summary. `callbacks`: extra Lightning
    callbacks (library use)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    setup_env(cfg)
    check_config(cfg)

    import lightning.pytorch as L
    import torch
    from hydra.utils import instantiate

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # after import: Lightning sets INFO on import
    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

    from lmlab.data.datamodule import TextDataModule
    from lmlab.lit import LitGPT
    from lmlab.monitor import StabilityMonitor
    from lmlab.progress import progress_bar

    source = prepare_init_from(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    data = TextDataModule(OmegaConf.to_container(cfg.data, resolve=True), seq_len=cfg.model.max_seq_len,
                          seed=cfg.seed, out_dir=str(run_dir))
    data.prepare_data()
    data.setup("fit")
    gcfg = arch_config(cfg, vocab_size=data.vocab_size).validate()
    unigram = data.unigram_entropy("train")  # the plateau a model that learnt only token frequencies sits on
    lit = LitGPT(model=gcfg.to_dict(), optim=OmegaConf.to_container(cfg.optim, resolve=True),
                 schedule=OmegaConf.to_container(cfg.schedule, resolve=True), max_steps=cfg.trainer.max_steps,
                 compile=cfg.compile,
                 divergence={**OmegaConf.to_container(cfg.divergence, resolve=True), "unigram": unigram})
    if source is not None:
        load_init_from(lit.model, gcfg.to_dict(), source)
    monitor = StabilityMonitor(**OmegaConf.to_container(cfg.monitor, resolve=True), unigram=unigram,
                               plot_dir=str(run_dir / "plots"))

    overrides = list(overrides or [])
    run_name = ",".join(o for o in overrides if not o.startswith("hydra")) or "default"
    ckpt_dir = run_dir / "checkpoints"
    checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="best", monitor="val/loss", mode="min", save_top_k=1,
                                 save_last=True, auto_insert_metric_name=False)
    last = ckpt_dir / "last.ckpt"
    ckpt_path = str(last) if cfg.resume and last.exists() else None
    if cfg.resume and ckpt_path is None:
        print(f"resume=true but {last} does not exist: starting from scratch")
    resume_step = None
    if ckpt_path:
        saved = torch.load(last, map_location="cpu", weights_only=False, mmap=True)
        check_same_arch(f"resume=true ({last})", gcfg.to_dict(), saved["hyper_parameters"]["model"],
                         ("dropout", *COMPUTE_KEYS))
        resume_step = int(saved["global_step"])
    loggers = build_loggers(cfg, run_dir, run_name, group, resume_step)
    callbacks = [checkpoint, monitor, *(callbacks or [])]
    if cfg.trainer.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(progress_bar())  # a caller's own bar wins
    trainer: L.Trainer = instantiate(cfg.trainer, default_root_dir=str(run_dir), use_distributed_sampler=False,
                                     logger=loggers, callbacks=callbacks)

    start, status, error = time.time(), "completed", None
    try:
        trainer.fit(lit, datamodule=data, ckpt_path=ckpt_path)
        if lit.divergence.status is not None:
            status = lit.divergence.status
        elif trainer.interrupted:
            status = "interrupted"
        if status != "diverged" and (not lit.val_history or lit.val_history[-1][0] != trainer.global_step):
            trainer.validate(lit, datamodule=data, verbose=False)  # a val loss at the final step
        trainer.save_checkpoint(last)  # a collective call: every rank, rank 0 writes
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C (Lightning turns it into SystemExit after its shutdown)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Lightning left SIGINT ignored
        status = "interrupted"
        trainer.save_checkpoint(last)  # resume=true continues from here
        raise
    except Exception as exc:  # recorded, then re-raised: the run dir keeps everything logged so far
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        wall = time.time() - start
        for logger in trainer.loggers:
            logger.finalize("success" if status == "completed" else status)
        summary = write_summary(run_dir, status=status, lit=lit, trainer=trainer, data=data, monitor=monitor,
                                wall_time=wall,
                                overrides=overrides, config=OmegaConf.to_container(cfg, resolve=True), error=error)
    return summary
