"""summary.json: one machine-readable line of truth per run (strict JSON: a non-finite number is null)."""

from __future__ import annotations

import math
import re
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

from lmlab import names
from lmlab.record.rundir import RunDir
from lmlab.record.targets import ToTarget, run_targets

STATUSES = ("completed", "diverged", "collapsed", "interrupted", "failed")
FINISHED = ("completed", "diverged", "collapsed")  # results: a resume leaves them as they are, the job exits 0
# The signals that interrupt a run (lmlab.run.interrupt) and the exit code an interrupted run's job then has: the
# shell's convention, 128 + the signal (130, 143, 138)
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
EXIT_CODES = {int(s): 128 + int(s) for s in SIGNALS}


def objective(summary: Mapping[str, Any] | None, figure: str = "best_val_loss") -> float:
    """What a hyper-parameter search minimises (train.py returns it): the run's best val loss, +inf for a run that
    did not complete (diverged, collapsed, failed, interrupted, or no summary) or never validated, so a diverging
    trial is the worst trial of a search, not an error. A val loss reached before a divergence doesn't count.
    `figure`: another best figure (compare ranks runs of different tokenizers by `best_val_bpb`; +inf without it)."""
    best = (summary or {}).get(figure)
    if (summary or {}).get("status") != "completed" or not isinstance(best, (int, float)) or not math.isfinite(best):
        return math.inf
    return float(best)


def recorded(cfg: Any) -> dict[str, Any]:
    """`cfg` resolved for the record (summary.json's `config`), except what comes from the environment: a value
    `${oc.env:NAME}` (a token, a password) is recorded as that text, never in clear, wherever it is used (directly
    or through another key's interpolation); .hydra/config.yaml keeps interpolations unresolved anyway."""
    from omegaconf import OmegaConf
    from omegaconf.basecontainer import BaseContainer

    original = BaseContainer._resolvers.get("oc.env")
    none = object()

    def as_text(key: str, default: Any = none) -> str:  # the default kept: the record resolves where the run did
        return "${oc.env:" + str(key) + ("}" if default is none else f",{_quoted(default)}}}")

    OmegaConf.register_new_resolver("oc.env", as_text, replace=True)
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    finally:
        if original is not None:
            BaseContainer._resolvers["oc.env"] = original


def _quoted(value: Any) -> str:
    """An interpolation argument for `value` (its own `${oc.env:...}` texts stay interpolations): null, or a quoted
    string."""
    if value is None:
        return "null"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"


class RunSummary(TypedDict, total=False):
    """summary.json, key by key: what every reader (eval, compare, search, tracking, the studies) may rely on. A task
    adds its own figures (`data.figures()`: probe_accuracy, ...); a record of an older lmlab may lack newer keys."""

    status: str  # one of STATUSES
    steps: int  # optimizer steps done
    tokens: int
    final_val_loss: float | None
    objective: str  # what val/loss and the val figures measure, when not the next token's cross-entropy (absent:
    #   next_token): masked_token (head=mlm: the chosen positions' cross-entropy, on the same masks in every run),
    #   label (head=classify: the label's cross-entropy; val_accuracy beside it)
    final_val_ema_loss: float | None  # optim.ema > 0 only: the last validation's loss of the weight EMA (val/ema_loss)
    final_val_ppl: float | None
    best_val_loss: float | None
    best_val_ppl: float | None
    final_val_bpb: float | None  # bits per byte at the last validation (val/bpb: the val nats / (ln 2 x the UTF-8
    #   bytes of text the val targets stand for), comparable across tokenizers; lmlab.data.token_bytes). Absent for a
    #   run without: a head that does not predict the next token (mlm, classify), data that is not text
    best_val_bpb: float | None  # the lowest val/bpb of the run
    val_curve: list[tuple[int, float | None]]  # (optimizer steps done, val loss) at every validation, resumes included
    to_target: list[ToTarget]  # per `targets:` val loss, the steps, tokens, FLOPs and seconds to it
                               # (lmlab.record.targets)
    unigram_val_loss: float | None  # entropy of the val split's unigram distribution: the best unigram model's loss
    val_loss_minus_unigram: float | None  # final val loss - the unigram entropy (nats): compare's loss_vs_unigram
    val_loss_over_unigram: float | None  # final val loss / the unigram entropy
    val_loss_vs_unigram: float | None  # the ratio, under its old name (kept for scripts that read it)
    diverged_at_step: int | None
    divergence_reason: str | None
    peak_grad_norm: float | None
    skipped_steps: list[int]  # spike_skip.enabled only: the steps whose update was skipped (lmlab.run.spikes)
    n_skipped_steps: int  # spike_skip.enabled only: their number (the W&B summary's figure; the list is not a scalar)
    grad_norm_at_init: dict[str, float] | None  # the gradient-norm profile at step 0 (embed, layer_XX, head)
    tokens_per_s: float | None  # this attempt's
    model_flops_per_s: float | None  # this attempt's: tokens_per_s x flops_per_token (compare's speed section)
    mfu: float | None  # model_flops_per_s over the devices' peak (perf.peak_flops, or a known GPU's), else None
    device: str | None  # cpu, or the GPU's name
    world_size: int
    wall_time_s: float
    n_params: int
    n_active_params: int  # the weights one token uses (an MoE's top_k experts of n_experts; n_params for a dense model)
    budget: dict[str, Any] | None  # the run's budget.* (lmlab.run.budget): flops, tokens, tokens_per_param or wall
    flops_per_token: float  # train FLOPs per token (lmlab.model.flops' count), what a budget was turned into steps by
    budget_spent: dict[str, Any]  # what the run spent of it: tokens, flops (and the wall time)
    stages: list[dict[str, Any]]  # data.batch_schedule / seq_schedule only (lmlab.data.stages.table): from_step,
    #   batch_size, seq_len, tokens_per_step, flops_per_token of each stage
    mixer_backend: str  # a model with recurrent mixers only: the path they ran (torch, fla, mamba_ssm; lmlab.model.mixer)
    fp8: list[str]  # precision.fp8 set only: the Linear layers trained in FP8, by qualified name (lmlab.run.fp8)
    overrides: list[str]
    error: str | None
    model: dict[str, Any]  # the GPTConfig record (lmlab.config), derived sizes included
    config: dict[str, Any]  # the whole resolved config
    signal: int | None  # the signal an interrupted run stopped for
    attempts: list[dict[str, Any]]  # one per start or resume: status, from_step, to_step, overrides, error, ...
    side: dict[str, list[str]]  # the model's side channel (lmlab.model.side): the metrics logged beside the LM loss
    #   per split ("train", "val": z_loss, moe_balance_loss, mtp_loss_1, ...) and the figure groups ("figures": moe)
    downstream: dict[str, Any] | None  # downstream.tasks set only: the latest lm-eval scores (lmlab.run.downstream)
    #   and their step, {"step": s, "metrics": {"downstream/<task>/<metric>": value}}; None before the first
    final_val_loss_by_source: dict[str, float] | None  # data=mixture only: val/loss/<source> at the last validation
    mixture: dict[str, dict[str, Any]] | None  # data=mixture only: each source's name (kind), weight, fraction of the
    #   training blocks, train_tokens, val_blocks (lmlab.data.mixture)
    relaunched: str | None  # each resume that went on at the same global batch on another launch (world size,
    #   strategy, accumulation): "at step 3: world_size 2 -> 4, ..."; that attempt's `changed` has key -> [was, now]


def _ppl(loss: float | None) -> float | None:
    return math.exp(min(loss, 50.0)) if loss is not None and math.isfinite(loss) else None


def _bpb(lit) -> dict[str, float | None]:
    """final_val_bpb and best_val_bpb, for a run that has bits per byte (none: the summary as before)."""
    if lit.bytes_per_token is None and not lit.val_bpb_history:
        return {}
    bpbs = [bpb for _, bpb in lit.val_bpb_history if math.isfinite(bpb)]
    return {"final_val_bpb": lit.val_bpb_history[-1][1] if lit.val_bpb_history else None,
            "best_val_bpb": min(bpbs) if bpbs else None}


def summarize(*, status: str, lit, trainer, data, monitor, steps: int, wall_time: float, tokens_at_start: int,
              overrides: list[str], config: dict[str, Any], error: str | None = None) -> RunSummary:
    """The figures of a run from its live objects. `steps`: optimizer steps done (the resumed step when an attempt
    failed before Lightning restored its counters)."""
    assert status in STATUSES, status
    vals = [loss for _, loss in lit.val_history if math.isfinite(loss)]
    final = lit.val_history[-1][1] if lit.val_history else None
    unigram = data.unigram_entropy("val")
    return {
        "status": status,
        "steps": steps,
        "tokens": int(lit.tokens_seen),
        "final_val_loss": final,
        **({"objective": objective} if (objective := lit.model.head.objective) != "next_token" else {}),
        "final_val_ppl": _ppl(final),
        "best_val_loss": min(vals) if vals else None,
        "best_val_ppl": _ppl(min(vals)) if vals else None,
        **_bpb(lit),
        **({"final_val_ema_loss": lit.ema_val_history[-1][1] if lit.ema_val_history else None}
           if lit.hparams.optim.get("ema") else {}),  # a run without an EMA: its summary as before
        "val_curve": [(int(step), loss) for step, loss in lit.val_history],
        "unigram_val_loss": unigram,  # entropy of the val split's unigram distribution: the best unigram model
        "val_loss_minus_unigram": (final - unigram) if final is not None and unigram is not None else None,
        "val_loss_over_unigram": (final / unigram) if final is not None and unigram else None,
        "val_loss_vs_unigram": (final / unigram) if final is not None and unigram else None,  # (the ratio's old name)
        "diverged_at_step": lit.divergence.step,
        "divergence_reason": lit.divergence.reason,
        "peak_grad_norm": lit.peak_grad_norm,
        **({"skipped_steps": list(lit.spikes.skipped), "n_skipped_steps": len(lit.spikes.skipped)}
           if lit.spikes is not None else {}),  # spike_skip off: the summary as before
        "grad_norm_at_init": monitor.profile,
        "tokens_per_s": (lit.tokens_seen - tokens_at_start) / wall_time if wall_time > 0 else None,  # this attempt's
        "world_size": int(trainer.world_size),
        "wall_time_s": wall_time,
        "n_params": lit.model.num_params(),
        "n_active_params": lit.model.num_params(active=True),
        "side": lit.model.side(float(lit.hparams.optim.get("z_loss") or 0.0)),
        "overrides": overrides,
        **data.figures(),  # a task's own figures (data=position_probe); a corpus has none
        "error": error,
        "model": lit.hparams.model,
        "config": config,
    }


def record(run: RunDir, summary: RunSummary, *, started_at_step: int, started: float,
           previous: dict[str, Any] | None, targets: Sequence[float] = (),
           changed: dict[str, list[Any]] | None = None, killed: str | None = None) -> RunSummary:
    """Write `summary` with the run's history: one entry per start or resume (status, steps, error, overrides, and
    `changed`: what a resume's launch changed against its checkpoint, lmlab.run.plan.check_same_launch), the earlier
    ones
    kept from the previous summary, so a failed resume says what failed and when without losing what the run had
    reached; and what the run took to reach each of `targets` (its `to_target`, timed over every attempt).
    `killed`: the lock line of an attempt that ended without a summary (SIGKILL, the OOM killer, a lost node), which
    is recorded before this one as `killed`, from where the previous attempt ended to this start's checkpoint."""
    attempts = list((previous or {}).get("attempts") or [])
    if previous and not attempts:  # a summary from before attempts were recorded
        attempts = [{"status": previous.get("status"), "from_step": 0, "to_step": previous.get("steps"),
                     "overrides": previous.get("overrides"), "error": previous.get("error")}]
    if killed:
        since = re.search(r"since (\d{4}-\d\d-\d\d) (\d\d:\d\d:\d\d)", killed)
        attempts.append({"status": "killed", "from_step": attempts[-1]["to_step"] if attempts else 0,
                         "to_step": started_at_step, "overrides": None, "holder": killed,
                         "error": f"ended without a summary (killed: SIGKILL, out of memory, a lost node); its last "
                                  f"checkpoint was at step {started_at_step}",
                         **({"started": f"{since[1]}T{since[2]}"} if since else {})})
    attempts.append({"status": summary["status"], "from_step": started_at_step, "to_step": summary["steps"],
                     "overrides": summary["overrides"], "error": summary["error"],
                     "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(started)),
                     "wall_time_s": summary["wall_time_s"], **({"changed": changed} if changed else {})})
    relaunched = "; ".join(f"at step {a['from_step']}: " + ", ".join(f"{k} {was} -> {now}" for k, (was, now) in
                                                                      a["changed"].items())
                           for a in attempts if a.get("changed"))
    summary = RunSummary({**summary, "attempts": attempts, "relaunched": relaunched or None})  # a string: W&B's too
    summary["to_target"] = run_targets(summary, targets)
    run.write_summary(summary)
    return summary


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    summary = RunDir(run_dir).read_summary()
    if summary is None:
        raise FileNotFoundError(f"{Path(run_dir) / 'summary.json'} does not exist")
    return summary


def side(summary: dict[str, Any], metrics: dict[str, Any] | None = None) -> dict[str, list[str]]:
    """What a run's side channel held (RunSummary.side): its own record, or for a summary of an lmlab from before it
    was recorded, the figure groups its metrics.csv has (`metrics`: metric name -> series)."""
    recorded = summary.get("side")
    if isinstance(recorded, dict) and all(isinstance(recorded.get(k), list) for k in ("train", "val", "figures")):
        return recorded  # (a malformed record, hand-edited or hostile, is read as an older one)
    routed = any(k.startswith(f"{names.MOE}/") for k in metrics or {})  # moe/<figure>/layer_XX
    return {"train": [], "val": [], "figures": [names.MOE] if routed else []}
