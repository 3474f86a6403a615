"""summary.json: one machine-readable line of truth per run."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

STATUSES = ("completed", "diverged", "collapsed", "interrupted", "failed")


def _ppl(loss: float | None) -> float | None:
    return math.exp(min(loss, 50.0)) if loss is not None and math.isfinite(loss) else None


def write_summary(run_dir: Path, *, status: str, lit, trainer, data, monitor, wall_time: float, overrides: list[str],
                  config: dict[str, Any], error: str | None = None) -> dict[str, Any]:
    assert status in STATUSES, status
    vals = [loss for _, loss in lit.val_history if math.isfinite(loss)]
    final = lit.val_history[-1][1] if lit.val_history else None
    unigram = data.unigram_entropy("val")
    steps = int(trainer.global_step)
    summary = {
        "status": status,
        "steps": steps,
        "tokens": int(lit.tokens_seen),
        "final_val_loss": final,
        "final_val_ppl": _ppl(final),
        "best_val_loss": min(vals) if vals else None,
        "best_val_ppl": _ppl(min(vals)) if vals else None,
        "unigram_val_loss": unigram,  # entropy of the val split's unigram distribution: the best unigram model
        "val_loss_vs_unigram": (final / unigram) if final is not None and unigram else None,
        "diverged_at_step": lit.divergence.step,
        "divergence_reason": lit.divergence.reason,
        "peak_grad_norm": lit.peak_grad_norm,
        "grad_norm_at_init": monitor.profile,
        "tokens_per_s": lit.tokens_seen / wall_time if wall_time > 0 else None,
        "world_size": int(trainer.world_size),
        "wall_time_s": wall_time,
        "n_params": lit.model.num_params(),
        "overrides": overrides,
        "error": error,
        "model": lit.hparams.model,
        "config": config,
    }
    if trainer.is_global_zero:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return summary


def read_summary(run_dir: str | Path) -> dict[str, Any]:
    return json.loads((Path(run_dir) / "summary.json").read_text())
