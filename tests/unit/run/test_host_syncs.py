"""Nothing read back to the host in a step that logs nothing (issue 60): on a GPU each such read makes the host wait for
every queued kernel. Counted on the CPU with tests.syncs.HostSyncs (item, float, bool, tolist, cpu, data-sized
operators). The divergence rule, which used to read every step's loss, reads them all at the logging steps and still
names the step a read per step names."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lmlab import compose
from lmlab.model import moe as moe_mod
from lmlab.model.ffn import FFNS
from lmlab.registry import build
from lmlab.run.training import train
from tests.runs import tiny
from tests.syncs import HostSyncs

EVERY = 5  # trainer.log_every_n_steps and monitor.every_n_steps


class StepSyncs(Callback):
    """The host reads of each training step, from its batch's start to its end (forward, backward, optimizer step,
    the callbacks' and the loggers' work)."""

    def __init__(self) -> None:
        self.by_step: dict[int, list[tuple[str, str]]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._counter, self._step = HostSyncs().__enter__(), trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._counter.__exit__(None, None, None)
        self.by_step[self._step] = self._counter.calls


def _quiet(step: int) -> bool:
    """Neither Lightning's logging step ((step + 1) % every: rows are written there) nor the monitor's (step % every)."""
    return (step + 1) % EVERY != 0 and step % EVERY != 0


def _probe(corpus: Path, tmp_path: Path, *extra: str) -> tuple[dict, StepSyncs]:
    syncs = StepSyncs()
    cfg = compose(tiny(corpus, tmp_path / "cache", f"trainer.log_every_n_steps={EVERY}",
                       f"monitor.every_n_steps={EVERY}", "monitor.attn_every_n_steps=10", "trainer.max_steps=12",
                       "trainer.val_check_interval=100", "trainer.enable_progress_bar=true", *extra))
    return train(cfg, tmp_path / "run", callbacks=[syncs]), syncs


@pytest.mark.parametrize("extra", [(), ("ffn=moe", "ffn.n_experts=4", "ffn.capacity_factor=1.0",
                                        "ffn.balance_loss=0.01", "ffn.bias_update_rate=0.001")],
                         ids=["dense", "moe"])
def test_steps_that_log_nothing_read_nothing_back(corpus: Path, tmp_path: Path, extra: tuple[str, ...]) -> None:
    summary, syncs = _probe(corpus, tmp_path, *extra)
    assert summary["status"] == "completed"
    quiet = [s for s in syncs.by_step if _quiet(s)]
    assert len(quiet) >= 6
    assert {s: syncs.by_step[s] for s in quiet} == {s: [] for s in quiet}
    # the counter sees the reads where they belong: the logging step reads the losses for the divergence rule once
    assert any(op == "tolist" and "_diverged" in where for op, where in syncs.by_step[EVERY - 1])


def test_the_divergence_rule_names_the_same_step_read_at_logging_steps_only(corpus: Path, tmp_path: Path) -> None:
    """lr 1e3 without clipping diverges within a few steps; judged at every step (logging every step) and at every
    fifth, the rule names the same step, and the second run stops at the first logging step after it."""
    runs = {}
    for every in (1, EVERY):
        cfg = compose(tiny(corpus, tmp_path / "cache", "optim.lr=1e3", "optim.grad_clip=0", "schedule.warmup_steps=0",
                           "divergence.min_steps=2", f"trainer.log_every_n_steps={every}",
                           f"monitor.every_n_steps={every}"))
        runs[every] = train(cfg, tmp_path / f"run_{every}")
    at_once, deferred = runs[1], runs[EVERY]
    assert at_once["status"] == deferred["status"] == "diverged"
    assert deferred["diverged_at_step"] == at_once["diverged_at_step"] < 25
    assert deferred["divergence_reason"] == at_once["divergence_reason"]
    step = at_once["diverged_at_step"]
    assert at_once["steps"] <= step + 1  # stopped at once
    assert step + 1 <= deferred["steps"] <= step + EVERY  # stopped at the next logging step


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "padded_bmm"])
@pytest.mark.parametrize("capacity", [None, 0.75])
def test_an_moe_layer_routes_and_trains_without_a_host_read(grouped: bool, capacity: float | None,
                                                            monkeypatch) -> None:
    if not grouped:
        monkeypatch.setattr(moe_mod, "_grouped_mm_runs", lambda *a: False)
    m = build("ffn", FFNS, {"name": "moe", "n_experts": 4, "top_k": 2, "expert": "swiglu", "n_shared": 1,
                            "capacity_factor": capacity, "balance_loss": 0.01, "router_z_loss": 0.001},
              32, 24, activation={"name": "silu"}, bias=True).train()
    x = torch.randn(3, 10, 32)
    with HostSyncs() as syncs:
        y = m(x)
        (y.square().mean() + sum(t.value * t.weight for t in m.terms)).backward()
    assert syncs.calls == []
    assert m.c_fc.weight.grad.abs().sum() > 0 and m.router.weight.grad.abs().sum() > 0
    with HostSyncs() as syncs:  # the counter is not blind: bincount reads the maximum back
        torch.bincount(torch.tensor([0, 2]))
    assert [op for op, _ in syncs.calls] == ["aten.bincount.default"]
