"""The divergence rule (lmlab.run.monitor.Divergence), on loss sequences: non-finite losses, spikes past the running
minimum, the collapse plateau at a step, and the state a resume restores."""

from __future__ import annotations

import math

import pytest

from lmlab.run.monitor import Divergence


def _run(rule: Divergence, losses: list[float], start: int = 0) -> int | None:
    """Feed losses from step `start`; the step at which the rule stopped the run (None: it never did)."""
    for step, loss in enumerate(losses, start=start):
        if rule.check(step, loss):
            return step
    return None


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_diverges_at_once_even_before_min_steps(bad: float) -> None:
    rule = Divergence(min_steps=20)
    assert _run(rule, [4.0, 3.5, bad, 3.0]) == 2
    assert rule.status == "diverged" and "non-finite" in rule.reason


def test_a_spike_past_the_factor_times_the_running_minimum_diverges() -> None:
    losses = [4.0, 3.0, 2.0, 2.5, 5.9, 6.1]  # running minimum 2.0: 3 x 2.0 = 6.0
    rule = Divergence(spike_factor=3.0, min_steps=0)
    assert _run(rule, losses) == 5 and rule.status == "diverged" and "6.1 > 3.0 x running min 2" in rule.reason
    assert _run(Divergence(spike_factor=3.0, min_steps=0), losses[:5]) is None  # 5.9 < 6.0: not a spike


def test_spikes_count_only_from_min_steps_and_not_with_factor_zero() -> None:
    losses = [1.0, 10.0, 1.0, 1.0, 10.0]
    assert _run(Divergence(spike_factor=3.0, min_steps=4), losses) == 4  # step 1's spike is before min_steps
    assert _run(Divergence(spike_factor=0, min_steps=0), losses) is None  # 0 disables the spike rule


def test_collapse_is_the_mean_of_the_window_on_the_unigram_plateau_at_the_step() -> None:
    unigram = 3.3
    plateau = [3.25] * 30  # within 0.1 nats of the unigram entropy
    rule = Divergence(collapse_after=29, collapse_margin=0.1, window=20, unigram=unigram)
    assert _run(rule, plateau) == 29 and rule.status == "collapsed" and "3.3 nats" in rule.reason
    learning = [3.25] * 20 + [2.5] * 10  # the last 20 steps average 2.875: below the plateau
    assert _run(Divergence(collapse_after=29, window=20, unigram=unigram), learning) is None
    assert _run(Divergence(collapse_after=None, unigram=unigram), plateau) is None  # off
    assert _run(Divergence(collapse_after=29, unigram=None), plateau) is None  # no unigram figure: off
    assert _run(Divergence(collapse_after=50, unigram=unigram), plateau) is None  # checked at that step only


def test_a_resumed_rule_continues_with_the_saved_minimum_and_window() -> None:
    rule = Divergence(spike_factor=3.0, min_steps=0, window=4, collapse_after=7, unigram=3.3)
    assert _run(rule, [4.0, 2.0, 3.2, 3.3]) is None
    resumed = Divergence(spike_factor=3.0, min_steps=0, window=4, collapse_after=7, unigram=3.3)
    resumed.load_state_dict(rule.state_dict())
    assert resumed.best == 2.0 and list(resumed.recent) == [4.0, 2.0, 3.2, 3.3]
    assert _run(resumed, [6.5], start=4) == 4 and resumed.status == "diverged"  # 6.5 > 3 x the saved minimum 2.0
    assert _run(Divergence(spike_factor=3.0, min_steps=0), [6.5], start=4) is None  # a fresh rule would go on
