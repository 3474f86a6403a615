"""One training run, from a composed config to a run directory.

Order matters: every check that can fail on bad input runs before data is loaded or a step is taken; everything
that can refuse a resume (architecture, tokenizer, data) runs before the run directory is touched, so a refused
start leaves every file as it was; once training starts, whatever happens (completion, divergence, a signal, an
exception) ends with a summary.json, and the record of earlier attempts is kept.
"""

from __future__ import annotations

import logging
import signal
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from lmlab.run import budget, features, seeds

from lmlab import env, names
from lmlab.run.checks import check_config, check_launch, strategy_name  # noqa: F401  (importable here, as before)
from lmlab.cli import continue_command
from lmlab.env import is_rank_zero
from lmlab.run.plan import (  # noqa: F401  (check_same_arch, prepare_init_from, ...: importable here, as before)
    EXTENSIBLE,
    RESUME_MODES,
    check_same_arch,
    check_same_data,
    continuing,
    load_init_from,
    make_plan,
    prepare_init_from,
    resume_checkpoint,
    resume_mode,
)
from lmlab.record.rundir import RunDir, RunLock
from lmlab.record.targets import check_targets

if TYPE_CHECKING:
    from lmlab.model.gpt import GPT


def setup_env(cfg: DictConfig) -> None:
    """The run's process environment (lmlab.env.setup): kept under this name for callers of earlier lmlab."""
    env.setup(cfg)


def train(cfg: DictConfig, run_dir: str | Path, overrides: list[str] | None = None, group: str | None = None,
          callbacks: list | None = None, hydra: Any = None, checked: GPT | None = None) -> dict[str, Any]:
    """Train as `cfg` says, writing everything into `run_dir`; return the summary. `group`: the W&B group (None:
    named after the run directory, lmlab.record.tracking.group_name); `callbacks`: extra Lightning callbacks (library
    use); `hydra`: Hydra's own config, written to .hydra/hydra.yaml (the CLI passes it); `checked`: the meta model
    `check_config(cfg, overrides)` returned, when the caller has checked the config (the command does, before
    Lightning is imported): not checked, nor built, again.

    The summary's `status` says how the run ended; an interrupted run (a signal) returns with status
    `interrupted` after saving its checkpoint, and train.py turns that into a non-zero exit code."""
    from lmlab.run.interrupt import StopOnSignal

    run = RunDir(run_dir)
    stop = StopOnSignal(str(run.last)).install()  # from the start: a signal while data is prepared stops at once
    try:
        env.filter_warnings()
        if checked is None:
            checked = check_config(cfg, overrides)
        setup_env(cfg)
        mode = resume_mode(cfg)
        lock = RunLock(run.path).acquire() if is_rank_zero() else None  # ranks > 0 write nothing into the directory
        if lock is not None:
            run.clean_temporaries()  # what a killed writer left: ours now that we hold the lock
        try:
            return _train(cfg, run, mode, list(overrides or []), group, list(callbacks or []), hydra, stop,
                          killed=lock.stale if lock is not None else None, checked=checked)
        finally:
            if lock is not None:
                lock.release()
    finally:
        stop.restore()


def _train(cfg: DictConfig, run: RunDir, mode: str, overrides: list[str], group: str | None, callbacks: list,
           hydra: Any, stop, killed: str | None = None, checked: GPT | None = None) -> dict[str, Any]:
    import lightning.pytorch as L
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # after import: Lightning sets INFO on import
    from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar

    from lmlab.model.flops import flops_per_token
    from lmlab.model.mixer.backend import paths_taken
    from lmlab.run.interrupt import EXIT_CODES, RunInterrupted, StopAtOnce, requeue_on_slurm
    from lmlab.run.lit import LitGPT
    from lmlab.run.lit_data import lightning_data
    from lmlab.run.monitor import StabilityMonitor
    from lmlab.run.perf import Throughput
    from lmlab.run.progress import progress_bar
    from lmlab.record.rundir import atomic_checkpoint_io
    from lmlab.record.summary import STATUSES, record, recorded, summarize
    from lmlab.record.tracking import Tracking
    from lmlab.record.trusted import build

    # --- everything that can refuse the start, before the run directory is touched ---
    plan = make_plan(cfg, run, mode, strategy_name(cfg), announce=_announce(run, overrides, hydra),
                     overrides=overrides, checked=checked)
    stop.prepared()  # from here a signal stops the run at a step boundary, with a checkpoint
    cfg, gcfg, data, source, ckpt, saved = plan.cfg, plan.model, plan.data, plan.source, plan.ckpt, plan.saved
    resume_step, previous = plan.resume_step, plan.previous
    if plan.ended:  # a no-op: every file stays as it was
        print(f"{run.path}: the run has ended ({previous['status']} at step {previous.get('steps')}; "
              f"trainer.max_steps={cfg.trainer.max_steps}): nothing to resume")
        return previous
    unigram = data.unigram_entropy("train")  # the plateau a model that learnt only token frequencies sits on
    lit = LitGPT(model=gcfg.to_dict(), optim=OmegaConf.to_container(cfg.optim, resolve=True),
                 schedule=OmegaConf.to_container(cfg.schedule, resolve=True), max_steps=cfg.trainer.max_steps,
                 compile=cfg.compile,
                 divergence={**OmegaConf.to_container(cfg.divergence, resolve=True), "unigram": unigram},
                 spike_skip=OmegaConf.to_container(OmegaConf.select(cfg, "spike_skip", default={}), resolve=True),
                 seed=int(cfg.seeds.data),  # head=mlm's masks are a function of (the data seed, sample)
                 stages=plan.stages)  # data.batch_schedule / seq_schedule (lmlab.data.stages): None without
    if source is not None:
        load_init_from(lit.model, gcfg.to_dict(), source)
    # the run-time features the config turns on (lmlab.run.features), before the first forward: a feature may change
    # the model (precision.fp8) or refuse the start (a downstream task that cannot load)
    started = features.start(cfg, features.Start(run, lit.model, data, previous if saved is not None else None,
                                                 resume_step))
    if saved is not None:
        lit.on_load_checkpoint(saved)  # the run's figures so far, even if this attempt fails before fit restores
    monitor = StabilityMonitor(**OmegaConf.to_container(cfg.monitor, resolve=True), unigram=unigram,
                               plot_dir=str(run / "plots"))

    # --- the start is accepted: now the directory is written ---
    if is_rank_zero():
        if mode == "false" and run.holds_run():
            run.clear()  # overwrite=true (resume_checkpoint refused it otherwise)
        run.write_config(cfg, overrides, hydra)
        if saved is None or not run.tokenizer.is_file():  # a resume has checked it builds the run's tokenizer
            data.save_tokenizer(run.tokenizer)

    checkpoint = ModelCheckpoint(dirpath=run / "checkpoints", filename="best", monitor=names.VAL_LOSS, mode="min",
                                 save_top_k=1, save_last=True, auto_insert_metric_name=False)
    throughput = Throughput(flops_per_token(lit.model, gcfg.max_seq_len)["train"],
                            OmegaConf.select(cfg, "perf.peak_flops", default=None))
    callbacks = [checkpoint, *features.callbacks(started, "checkpoint"), monitor, throughput, stop,
                 *data.callbacks(run.path),  # a task's own metrics (data=position_probe); a corpus has none
                 *features.callbacks(started, "task"), *callbacks]
    if cfg.trainer.get("enable_progress_bar", True) and not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(progress_bar())  # a caller's own bar wins
    from lmlab.record.sweep import swept_tags

    tracking = Tracking.start(cfg, run, overrides=overrides, group=group, n_params=lit.model.num_params(),
                              n_active_params=lit.model.num_params(active=True),
                              resume_step=resume_step if saved is not None else None,
                              tags=swept_tags(hydra, overrides))  # a sweep job: the values of the swept keys
    # trainer.val_check_interval is in optimizer steps (checks.py: an integer >= 1); Lightning counts it in batches,
    # which under accumulation validated accumulate_grad_batches times as often, and at other steps after a resume
    # that changed the accumulation
    every = {"val_check_interval": int(cfg.trainer.val_check_interval) * int(cfg.trainer.get(
        "accumulate_grad_batches", 1))} if cfg.trainer.get("val_check_interval") is not None else {}
    trainer: L.Trainer = build(cfg.trainer, "trainer", L.Trainer, default_root_dir=str(run.path),  # lmlab.record.trusted
                               use_distributed_sampler=False, logger=tracking.loggers, callbacks=callbacks,
                               plugins=[atomic_checkpoint_io()], **every)
    stop.take_over(trainer)

    # seeds.dropout (lmlab.run.seeds): training's draws from their own stream; unset, they go on from the init's
    seeds.reseed_training(seeds.Seeds(**cfg.seeds), resume_step)
    start, status, error, at_once = time.time(), "completed", None, None
    tokens_at_start = lit.tokens_seen
    try:
        trainer.fit(lit, datamodule=lightning_data(data), ckpt_path=str(ckpt) if ckpt else None, weights_only=True)
        stop.record()
        if lit.divergence.status is not None:
            status = lit.divergence.status
        if status != "diverged" and (
                not lit.val_history or lit.val_history[-1][0] != trainer.global_step):
            trainer.validate(lit, datamodule=lightning_data(data), verbose=False)  # a val loss at the final step
        trainer.save_checkpoint(run.last)  # a collective call: every rank, rank 0 writes
    except RunInterrupted:  # a signal: the checkpoint is saved at the step boundary
        stop.record()
        status = "interrupted"
    except StopAtOnce as stopped:  # a signal before this attempt's first step was done: nothing new to save
        stop.record()
        status, stop.signum, at_once = "interrupted", stopped.signum, stopped.signum
    except (KeyboardInterrupt, SystemExit):  # Ctrl-C pressed twice (Lightning turns it into SystemExit(1))
        stop.record()
        status, stop.signum, at_once = "interrupted", int(signal.SIGINT), int(signal.SIGINT)
        trainer.save_checkpoint(run.last)  # at the start of the step it stopped in: resume continues from there
    except Exception as exc:  # recorded, then re-raised: the run dir keeps everything logged so far
        stop.record()
        status, error = "failed", f"{type(exc).__name__}: {exc}"
        raise
    finally:
        wall = time.time() - start
        for logger in trainer.loggers:
            logger.finalize("success" if status == "completed" else status)
        assert status in STATUSES
        summary = summarize(status=status, lit=lit, trainer=trainer, data=data, monitor=monitor,
                            steps=max(int(trainer.global_step), resume_step), wall_time=wall,
                            tokens_at_start=tokens_at_start, overrides=overrides,
                            config=recorded(cfg), error=error)  # ${oc.env:...} as written, not in clear
        summary["signal"] = stop.signum or None
        staged = budget.stage_table(cfg, lit.model) if plan.stages is not None else None  # each stage's tokens,
        summary.update(budget.spent(plan.budget, summary, throughput.flops_per_token, staged))  # FLOPs per token
        summary.update(throughput.figures(summary["tokens_per_s"], summary["world_size"]))  # FLOP/s, MFU, device
        if staged is not None:  # compare's *_to_target count through them
            summary["stages"] = staged
        if mixer_paths := paths_taken(lit.model):  # the recurrent mixers' path: torch, or their kernel (a hybrid only)
            summary["mixer_backend"] = ",".join(mixer_paths)
        for feature in started.values():  # what the features on report (precision.fp8's layers, downstream's last
            summary.update(feature.figures())  # values); a feature off leaves the summary as before
        if trainer.is_global_zero:
            summary = record(run, summary, started_at_step=resume_step, started=start, previous=previous,
                             targets=check_targets(cfg.get("targets")), changed=plan.changed, killed=killed)
        tracking.finish(summary)  # the job ends here, whatever its status: so does its W&B run
    if status == "interrupted" and trainer.is_global_zero:
        signum = stop.signum
        requeued = requeue_on_slurm(signum)
        saved_at = f"checkpoint {run.last}" if run.checkpoint() else "no checkpoint yet (no step was trained)"
        print(f"interrupted by signal {signum} at step {summary['steps']}: {saved_at}"
              + (f"; {requeued}" if requeued else "")
              + f"\n  to continue: {continue_command(run.path)}  (its own overrides are taken again)")
    if at_once:  # stopped mid-step: leave the caller's code too, with the shell's code for the signal (Lightning's was 1)
        raise SystemExit(EXIT_CODES[at_once])
    return summary


def _announce(run: RunDir, overrides: list[str], hydra: Any):
    """What a resume says first (lmlab.run.plan.continuing), on rank 0; Lightning's "Checkpoint directory ... exists and
    is not empty", which read like a fault, is not shown then. Library use without overrides has no command to name."""
    def say(step: int) -> None:
        warnings.filterwarnings("ignore", message=r".*Checkpoint directory .* exists and is not empty.*")
        if is_rank_zero():
            print(continuing(run, step, overrides if hydra is not None or overrides else None), flush=True)

    return say
