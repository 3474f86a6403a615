"""spike_skip in a real tiny run (lmlab.run.spikes): a bad batch injected at one step is skipped (no parameter or
optimizer state moves, the data and the schedule go on) and recorded in summary.json and metrics.csv; with or without
gradient accumulation; how it meets the divergence rule; a resume across a signal skips the same steps; two DDP ranks
decide as one process does."""

from __future__ import annotations

import copy
import csv
import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lmlab import compose
from lmlab.run.training import train
from tests.runs import CtrlC, metric, one_and_two_ranks, tiny

ON = ("spike_skip.enabled=true", "spike_skip.window=8")  # judged from step 8 on
ACCUMULATE = ("trainer.accumulate_grad_batches=2", "data.batch_size=4")  # the same global batch of 8, in two halves


class BadBatch(Callback):
    """At the given steps every target of the batch (each micro-batch of the step) is token 3: a loss and gradient
    spike from the data, the weights untouched."""

    def __init__(self, *steps: int) -> None:
        self.steps = steps

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step in self.steps:
            batch[1].fill_(3)


class NanLoss(Callback):
    """At step `at` the final norm's output is NaN, so is the loss (the weights untouched)."""

    def __init__(self, at: int) -> None:
        self.at, self.hook = at, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.at and self.hook is None:
            self.hook = pl_module.model.ln_f.register_forward_hook(lambda m, args, out: out * float("nan"))


class Snapshots(Callback):
    """The weights and the optimizer's state as each of `steps` starts (its first micro-batch)."""

    def __init__(self, *steps: int) -> None:
        self.steps, self.taken = steps, {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        if step in self.steps and step not in self.taken:
            state = trainer.optimizers[0].state_dict()
            groups = [{k: v for k, v in g.items() if k not in ("lr", "initial_lr")} for g in state["param_groups"]]
            self.taken[step] = ({k: v.detach().clone() for k, v in pl_module.model.state_dict().items()},
                                copy.deepcopy(state["state"]), copy.deepcopy(groups),
                                copy.deepcopy(pl_module.ema.state_dict()) if pl_module.ema is not None else None)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _rows(run: Path) -> dict[int, dict[str, str]]:
    with open(run / "metrics.csv") as f:
        return {int(r["step"]): {k: v for k, v in r.items() if not k.startswith("perf/")} for r in csv.DictReader(f)}


@pytest.mark.parametrize("extra", [(), ACCUMULATE], ids=["plain", "accumulate"])
def test_a_bad_batch_is_skipped_recorded_and_its_update_left_out(corpus: Path, tmp_path: Path, extra) -> None:
    """The same run with the rule off and on, a bad batch at step 20: on, step 20's update is skipped (weights, AdamW's
    step and moments bit-identical across it; step 21 moves them), summary.json lists it, metrics.csv has
    train/skipped_step 1 there and 0 elsewhere; every row before the skip is the rule-off run's, and the learning
    rate and token count go on exactly as there. Off: the summary and metrics.csv as before (no skip keys)."""
    from lmlab.record.tracking import _figures

    cache = tmp_path / "cache"
    off = train(compose(tiny(corpus, cache, *extra)), tmp_path / "off", callbacks=[BadBatch(20)])
    snapshots = Snapshots(20, 21, 22)
    on = train(compose(tiny(corpus, cache, *extra, *ON)), tmp_path / "on", callbacks=[BadBatch(20), snapshots])

    assert on["status"] == off["status"] == "completed" and on["steps"] == off["steps"] == 30
    assert on["skipped_steps"] == [20] and on["n_skipped_steps"] == 1
    assert json.loads((tmp_path / "on" / "summary.json").read_text())["skipped_steps"] == [20]
    assert _figures(on)["n_skipped_steps"] == 1  # what the W&B summary gets (the list is no scalar)
    assert "skipped_steps" not in off and "n_skipped_steps" not in off
    assert metric(tmp_path / "on", "train/skipped_step") == {s: float(s == 20) for s in range(30)}

    before, after, next_ = (snapshots.taken[s] for s in (20, 21, 22))
    assert all(_same(a, b) for a, b in zip(before, after))  # weights, optimizer state, group settings
    assert all(float(s["step"]) == 20 for s in after[1].values())  # AdamW counted 20 steps, not 21
    assert not _same(after[0], next_[0]) and not _same(after[1], next_[1])  # step 21 trains as usual
    assert metric(tmp_path / "on", "update/ratio/layer_00")[20] == 0.0  # the monitor sees nothing move

    a, b = _rows(tmp_path / "off"), _rows(tmp_path / "on")
    assert sorted(a) == sorted(b)
    for step in range(20):  # the rule changes nothing until it skips
        assert {k: v for k, v in b[step].items() if k != "train/skipped_step"} == a[step], step
    for name in ("train/loss", "grad/norm"):  # step 20's, measured before its update
        assert b[20][name] == a[20][name], name
    for name in ("lr", "tokens"):  # the schedule and the data move on
        assert metric(tmp_path / "on", name) == metric(tmp_path / "off", name)
    assert metric(tmp_path / "on", "train/loss")[21] != metric(tmp_path / "off", "train/loss")[21]
    assert "train/skipped_step" not in (tmp_path / "off" / "metrics.csv").read_text().splitlines()[0]


def test_nothing_that_moves_with_an_update_moves_on_a_skipped_step(corpus: Path, tmp_path: Path) -> None:
    """An MoE with loss-free balancing, a weight EMA and QK-clip clipping every step: across the skipped step 20 the
    weights, the experts' balancing bias, the optimizer's state and the EMA stay bit-identical and QK-clip rescales no
    head (no figures logged there); at step 21 all of them move again."""
    from tests.e2e.model.test_moe import MOE

    run, snapshots = tmp_path / "run", Snapshots(20, 21, 22)
    summary = train(compose(tiny(corpus, tmp_path / "cache", *MOE, "optim.ema=0.9", "optim.qk_clip=0.05", *ON)),
                    run, callbacks=[BadBatch(20), snapshots])
    assert summary["skipped_steps"] == [20]
    before, after, next_ = (snapshots.taken[s] for s in (20, 21, 22))
    assert all(_same(a, b) for a, b in zip(before, after))
    assert before[0]["h.0.mlp.expert_bias"].abs().sum() > 0  # the bias the balancing moves, kept across the skip
    assert all(not _same(a, b) for a, b in zip(after, next_) if a is not after[2])  # (the group settings stay)
    clipped = metric(run, "attn/qk_clipped_heads")
    assert 20 not in clipped and clipped[19] > 0 and clipped[21] > 0


def test_a_skipped_spike_is_no_divergence_but_a_spike_the_rule_lets_through_is(corpus: Path, tmp_path: Path) -> None:
    """divergence.spike_factor=1.3, the bad batch at step 20 past it: without spike_skip the run diverges there; with
    it the step is skipped and the run completes. With a window that never fills (nothing is judged) the divergence
    rule still ends the run at the same step, and a non-finite loss always does (neither recorded as a skip)."""
    cache = tmp_path / "cache"
    factor = "divergence.spike_factor=1.3"
    off = train(compose(tiny(corpus, cache, factor)), tmp_path / "off", callbacks=[BadBatch(20)])
    assert off["status"] == "diverged" and off["diverged_at_step"] == 20
    on = train(compose(tiny(corpus, cache, factor, *ON)), tmp_path / "on", callbacks=[BadBatch(20)])
    assert on["status"] == "completed" and on["diverged_at_step"] is None and on["skipped_steps"] == [20]

    unjudged = train(compose(tiny(corpus, cache, factor, "spike_skip.enabled=true", "spike_skip.window=64")),
                     tmp_path / "unjudged", callbacks=[BadBatch(20)])
    assert unjudged["status"] == "diverged" and unjudged["skipped_steps"] == []
    assert (unjudged["diverged_at_step"], unjudged["steps"]) == (off["diverged_at_step"], off["steps"])
    assert "1.3 x running min" in unjudged["divergence_reason"]

    nan = train(compose(tiny(corpus, cache, *ON)), tmp_path / "nan", callbacks=[NanLoss(12)])
    assert nan["status"] == "diverged" and nan["diverged_at_step"] == 12 and nan["skipped_steps"] == []
    assert "non-finite" in nan["divergence_reason"]


def test_a_resume_across_a_signal_skips_the_same_steps(corpus: Path, tmp_path: Path) -> None:
    """Bad batches at steps 12 and 22 (past the window of 8 that holds step 12's spike), Ctrl-C before step 17,
    resume: the skip before the signal is kept and the one after it judged on the saved window (a fresh one would not
    judge step 22 at all), so summary.json's skipped steps and every row of metrics.csv are the uninterrupted run's.
    Logged every 5 steps: a skipped step's row is written between them all the same."""
    cache, every = tmp_path / "cache", "trainer.log_every_n_steps=5"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(compose(tiny(corpus, cache, *ON, every)), straight, callbacks=[BadBatch(12, 22)])
    with pytest.raises(SystemExit):
        train(compose(tiny(corpus, cache, *ON, every)), resumed, callbacks=[BadBatch(12, 22), CtrlC(at=17)])
    assert json.loads((resumed / "summary.json").read_text())["skipped_steps"] == [12]
    train(compose(tiny(corpus, cache, *ON, every, "resume=true")), resumed, callbacks=[BadBatch(12, 22)])

    summaries = [json.loads((run / "summary.json").read_text()) for run in (straight, resumed)]
    assert summaries[0]["skipped_steps"] == summaries[1]["skipped_steps"] == [12, 22]
    a, b = _rows(straight), _rows(resumed)
    assert sorted(a) == sorted(b) and {12, 22} <= set(a)
    for step in a:
        assert a[step] == b[step], step
    logged = metric(straight, "train/skipped_step")
    assert {s for s, v in logged.items() if v} == {12, 22} and {4, 9, 14, 19, 24, 29} <= set(logged)


def test_two_ddp_ranks_skip_the_steps_one_process_skips(corpus: Path, tmp_path: Path) -> None:
    """A tight rule (window 4, sigma 1) that skips ordinary steps: 2 DDP ranks x 4 sequences judge the loss averaged
    over the ranks and the global gradient norm, so both ranks skip what one process of 8 skips; and that process's
    skips are the rule replayed on its metrics.csv (train/loss, grad/norm)."""
    from lmlab.run.spikes import SpikeSkip

    rule = ("spike_skip.enabled=true", "spike_skip.window=4", "spike_skip.sigma=1.0", "trainer.max_steps=20")
    args = [a for a in tiny(corpus, tmp_path / "cache", *rule) if not a.startswith("data.batch_size")]
    one, two = one_and_two_ranks(args, tmp_path)
    skipped = [json.loads((run / "summary.json").read_text())["skipped_steps"] for run in (one, two)]
    assert skipped[0] == skipped[1] and len(skipped[0]) >= 2, skipped
    replay = SpikeSkip(window=4, sigma=1.0)
    loss, norm = metric(one, "train/loss"), metric(one, "grad/norm")
    for step in sorted(loss):
        replay.check(step, loss=loss[step], grad_norm=norm[step])
    assert replay.skipped == skipped[0]
    assert metric(two, "train/skipped_step") == {s: float(s in skipped[0]) for s in range(20)}
