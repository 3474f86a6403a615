"""The cost of the Lightning loop (LitGPT + StabilityMonitor + metrics.csv) over the bare step."""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch

from lmlab.bench.timing import Contestant, spread, timed


def lightning_loop_cost(cfg, lit, batches: list, precision: str, device: torch.device, sync: Callable,
                        repeats: int) -> dict[str, Any]:
    """Seconds per step of `trainer.fit` (LitGPT + StabilityMonitor at the configured frequency + metrics.csv
    logger, as train.py sets them up) vs the bare loop, both from a fresh optimizer.

    A fit runs len(batches) steps; the window is steps 1 .. len-1 (one monitor cycle with the default 10, whose
    step 10 is a monitor step; each step from its on_train_batch_start to the next, the last to its
    on_train_batch_end) against the same steps of the bare loop. Step 0 also carries the once-per-run
    init profile and the attention figures (every `attn_every_n_steps`); its extra time over a plain Lightning
    step is reported and amortised over the attention period in `ratio_amortised`, the figure the target reads.
    """
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback
    from omegaconf import OmegaConf

    from lmlab.record.metrics_csv import MetricsCSV
    from lmlab.run.monitor import StabilityMonitor

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            sync()
            self.marks.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step >= trainer.max_steps:  # the last step's end, after the monitor's hook; the
                sync()  # fit's teardown (end of epoch, logger finalize) is not a per-step cost
                self.marks.append(time.perf_counter())

    monitor_cfg = OmegaConf.to_container(cfg.monitor, resolve=True)

    def fit() -> list[float]:
        """Seconds of each step: its work, its hooks and logging, and the next batch's fetch."""
        timer = StepTimer()
        with tempfile.TemporaryDirectory() as tmp:
            trainer = L.Trainer(accelerator=device.type, devices=1, precision=precision, max_steps=len(batches),
                                logger=MetricsCSV(tmp), callbacks=[StabilityMonitor(**monitor_cfg), timer],
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp,
                                log_every_n_steps=cfg.trainer.log_every_n_steps)
            trainer.fit(lit, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
        return [b - a for a, b in zip(timer.marks, timer.marks[1:])]

    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16-mixed" else nullcontext

    def bare() -> float:
        lit.to(device)  # the fit's teardown moved it back to the CPU
        c = Contestant("bare", lit.model, lit.loss, lit.configure_optimizers(), cfg.optim.get("grad_clip", 0.0),
                       autocast)
        c.train_step(batches[0])  # step 0 (optimizer state allocated), outside the window as in the fit
        return timed(c.train_step, batches[1:], sync)

    fit(), bare()  # warm-up: Lightning's first fit imports and sets up more than later ones
    loop, plain, first_extra = [], [], []
    for r in range(repeats):  # A B, then B A: a drift in machine speed hits both sides alike
        each = fit() if r % 2 == 0 else None
        plain.append(bare())
        each = each or fit()
        loop.append(statistics.mean(each[1:]))
        first_extra.append(each[0] - statistics.median(each[1:]))
    ratios = [a / b for a, b in zip(loop, plain)]
    period = monitor_cfg.get("attn_every_n_steps") or len(batches)
    amortised = [r + max(e, 0.0) / period / b for r, e, b in zip(ratios, first_extra, plain)]
    return {"window_steps": len(batches) - 1, "lightning_step_s": statistics.median(loop),
            "bare_step_s": statistics.median(plain), "ratio": spread(ratios),
            "step0_extra_s": statistics.median(first_extra), "ratio_amortised": spread(amortised),
            "lightning_each_step_s": each, "monitor": monitor_cfg}
