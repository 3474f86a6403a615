"""`tokens` and `tokens_per_s` (summary.json, metrics.csv's tokens and perf/tokens_per_s, perf/mfu) against the batches
a run actually consumed, counted by a callback of the test (each step's batch numel x world size): a run stopped at
step k and resumed to n has n x the global batch's tokens, and its resumed attempt's speed counts that attempt's
tokens only, over its own time. perf's clock is replaced by one that moves a second per training step, so the live
figure is exact. (Two ranks, DDP and FSDP2: tests/e2e/run/test_token_accounting.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from lightning.pytorch.callbacks import Callback

from lmlab import compose
from lmlab.run.training import train
from tests.runs import CtrlC, metric, tiny

B, T = 8, 32  # tests.runs.tiny's batch and length: 256 tokens a step
PEAK = 1e9  # perf.peak_flops: a made-up device, so that perf/mfu is logged on the CPU


class Consumed(Callback):
    """Counts the tokens of the training batches the steps consumed (batch numel x world size) and, as perf's clock,
    moves one second at the start of each training batch and half a second at each validation batch (which the live
    speed leaves out); nothing else takes time on it."""

    def __init__(self) -> None:
        self.tokens, self.steps, self.now = 0, 0, 1000.0

    def perf_counter(self) -> float:
        return self.now

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.now += 1.0

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.now += 0.5

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.tokens += batch[0].numel() * trainer.world_size
        self.steps += 1


class PretendWorld(Callback):
    """This process as rank 0 of a world of `size` (Lightning's one-device strategy says 1), from the fit's setup on:
    the data reads this rank's share of each global batch, and everything that counts ranks sees `size`."""

    def __init__(self, size: int) -> None:
        self.size = size

    def setup(self, trainer, pl_module, stage: str) -> None:
        trainer.strategy.world_size = self.size


def _run(corpus: Path, tmp_path: Path, run: Path, monkeypatch, *extra: str, stop_at: int | None = None,
         world: Callback | None = None) -> tuple[dict, Consumed]:
    import lmlab.run.perf as perf

    consumed = Consumed()
    monkeypatch.setattr(perf, "time", SimpleNamespace(perf_counter=consumed.perf_counter))
    cfg = compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=9", "trainer.val_check_interval=3",
                       f"perf.peak_flops={PEAK}", *extra))
    if stop_at is None:
        return train(cfg, run, callbacks=[*([world] if world else []), consumed]), consumed
    with pytest.raises(SystemExit):  # Ctrl-C before step `stop_at`: the checkpoint holds stop_at steps
        train(cfg, run, callbacks=[consumed, CtrlC(at=stop_at)])
    return json.loads((run / "summary.json").read_text()), consumed


def _check_speed(summary: dict, attempt_tokens: int) -> None:
    """tokens_per_s x the attempt's wall time is the attempt's tokens; the FLOP/s and MFU follow from it."""
    assert summary["tokens_per_s"] * summary["wall_time_s"] == pytest.approx(attempt_tokens, rel=1e-9)
    assert summary["attempts"][-1]["wall_time_s"] == summary["wall_time_s"]
    rate = summary["tokens_per_s"] * summary["flops_per_token"]
    assert summary["model_flops_per_s"] == pytest.approx(rate, rel=1e-9)
    assert summary["mfu"] == pytest.approx(rate / PEAK, rel=1e-9)


def test_tokens_and_speed_of_a_straight_run_are_the_batches_it_consumed(corpus: Path, tmp_path: Path,
                                                                         monkeypatch) -> None:
    run = tmp_path / "run"
    summary, consumed = _run(corpus, tmp_path, run, monkeypatch)
    assert summary["status"] == "completed" and consumed.steps == summary["steps"] == 9
    assert summary["tokens"] == consumed.tokens == 9 * B * T
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["tokens"] == summary["tokens"] and on_disk["tokens_per_s"] == summary["tokens_per_s"]
    _check_speed(on_disk, consumed.tokens)
    # metrics.csv: the tokens after each step (its logging step s is the (s + 1)-th), and the live speed: one step's
    # global batch per second of perf's clock, an MFU over the made-up peak
    assert metric(run, "tokens") == {s: (s + 1) * B * T for s in range(9)}
    assert metric(run, "perf/tokens_per_s") == {s: B * T for s in range(9)}
    flops = summary["flops_per_token"]
    assert metric(run, "perf/mfu") == pytest.approx({s: B * T * flops / PEAK for s in range(9)}, rel=1e-9)


@pytest.mark.parametrize("batching", [(), ("data.batch_size=4", "trainer.accumulate_grad_batches=2")],
                         ids=["batch", "accumulated"])
def test_a_resumed_run_counts_every_attempts_tokens_and_its_speed_only_its_own(corpus: Path, tmp_path: Path,
                                                                                monkeypatch, batching) -> None:
    """Stopped before step 4 and resumed to 9: 9 global batches in all (8 x 32 tokens each, also as 2 micro-batches
    of 4), the resumed attempt's speed its 5 steps' tokens over its own wall time, and the live speed after the resume
    one global batch a second (not the earlier attempt's tokens over the first step's second)."""
    run, k, n = tmp_path / "run", 4, 9
    first, before = _run(corpus, tmp_path, run, monkeypatch, *batching, stop_at=k)
    assert first["status"] == "interrupted" and first["steps"] == k
    assert first["tokens"] == before.tokens == k * B * T
    _check_speed(first, before.tokens)
    summary, after = _run(corpus, tmp_path, run, monkeypatch, *batching, "resume=true")
    assert summary["status"] == "completed" and summary["steps"] == n
    assert after.tokens == (n - k) * B * T  # what the resumed attempt consumed
    assert summary["tokens"] == before.tokens + after.tokens == n * B * T
    _check_speed(summary, after.tokens)
    assert [(a["from_step"], a["to_step"]) for a in summary["attempts"]] == [(0, k), (k, n)]
    assert metric(run, "tokens") == {s: (s + 1) * B * T for s in range(n)}
    speeds = metric(run, "perf/tokens_per_s")
    micro = 2 if batching else 1  # perf's clock moves a second per micro-batch: a step is `micro` seconds
    assert set(speeds) == set(range(n)) and all(v == pytest.approx(B * T / micro) for v in speeds.values()), speeds


def test_one_rank_counts_the_tokens_of_every_ranks_batch(corpus: Path, tmp_path: Path, monkeypatch) -> None:
    """The unit tier's stand-in for two ranks (the real ones: tests/e2e/run/test_token_accounting.py): this process as
    rank 0 of a world of 2, which reads every other batch of the global one. Each rank's `tokens` counts the global
    batch, its speed too, and MFU is over the peak of both devices."""
    run = tmp_path / "run"
    summary, consumed = _run(corpus, tmp_path, run, monkeypatch, world=PretendWorld(2))
    assert summary["status"] == "completed" and summary["world_size"] == 2
    assert summary["tokens"] == consumed.tokens == 9 * 2 * B * T
    assert summary["tokens_per_s"] * summary["wall_time_s"] == pytest.approx(consumed.tokens, rel=1e-9)
    assert summary["mfu"] == pytest.approx(summary["model_flops_per_s"] / (2 * PEAK), rel=1e-9)
    assert metric(run, "tokens") == {s: (s + 1) * 2 * B * T for s in range(9)}
    assert metric(run, "perf/tokens_per_s") == {s: 2 * B * T for s in range(9)}
    flops = summary["flops_per_token"]
    assert metric(run, "perf/mfu") == pytest.approx({s: 2 * B * T * flops / (2 * PEAK) for s in range(9)}, rel=1e-9)
