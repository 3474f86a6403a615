"""Target crossings (lmlab.record.targets) off the midpoint: a crossing 30% (or 80%) of the way between two
validations, worked out by hand, so that an interpolation weighted from the wrong end (which agrees at the midpoint)
fails; likewise the tokens read off a metrics.csv curve, and the tokens and FLOPs summed through a batch schedule's
stages."""

from __future__ import annotations

import math

import pytest

from lmlab import names
from lmlab.record.targets import crossing, run_targets, through, to_target

# validations after 4, 8 and 12 optimizer steps; 10 was non-finite (null in JSON); 256 tokens a step
CURVE = [[4, 3.3], [8, 3.1], [10, None], [12, 2.9]]
SUMMARY = {"val_curve": CURVE, "steps": 12, "tokens": 12 * 256, "flops_per_token": 1000.0, "wall_time_s": 5.0,
           "attempts": [{"status": "interrupted", "wall_time_s": 7.0}, {"status": "completed", "wall_time_s": 5.0}]}


def test_a_crossing_30_percent_of_the_way_between_two_validations() -> None:
    # 3.24 is 0.06 below 3.3 of the 0.2 drop to 3.1: 30% of the 4 steps from step 4, step 5.2 (70% would be 6.8)
    assert crossing(CURVE, 3.24) == pytest.approx(5.2)
    # 2.94 is 0.16 of the 0.2 from 3.1 (step 8) to 2.9 (step 12; step 10's null skipped): 80%, step 11.2
    assert crossing(CURVE, 2.94) == pytest.approx(11.2)
    # rising then falling: the first validation at or below the target, and the one before it
    assert crossing([(0, 5.0), (10, 3.0), (20, 4.0), (30, 2.0)], 3.5) == pytest.approx(7.5)  # 1.5 of the 2.0 drop
    # a non-finite validation (a live curve's nan or inf) is no bracket: from 3.3 at step 4 to 2.9 at 12, 75%
    for bad in (math.nan, math.inf):
        assert crossing([(4, 3.3), (8, bad), (12, 2.9)], 3.0) == pytest.approx(10.0)


def test_the_figures_to_a_target_off_the_midpoint() -> None:
    got = run_targets(SUMMARY, [3.24])[0]
    # step 5.2: 5.2 x 256 tokens, x 1000 FLOPs each, and 5.2/12 of the 7 + 5 s over both attempts
    assert got == pytest.approx({"target": 3.24, "steps_to_target": 5.2, "tokens_to_target": 1331.2,
                                 "flops_to_target": 1_331_200.0, "time_to_target_s": 5.2})


def test_tokens_read_off_a_metrics_csv_curve_off_the_midpoint() -> None:
    """An older run (no val_curve): the tokens curve interpolated at the crossing, 30% of the way from 500 (step 4) to
    1700 (step 8): 500 + 0.3 x 1200 = 860, where the steps x tokens-per-step rule would say 1331.2."""
    series = {names.VAL_LOSS: [(4, 3.3), (8, 3.1)], names.TOKENS: [(0, 100), (4, 500), (8, 1700)]}
    summary = {"steps": 12, "tokens": 12 * 256, "wall_time_s": 12.0}
    got = to_target(series, summary, 3.24, 1000.0)
    assert got == pytest.approx({"steps_to_target": 5.2, "tokens_to_target": 860.0, "flops_to_target": 860_000.0,
                                 "time_to_target_s": 5.2})


def test_tokens_and_flops_through_a_schedules_stages_off_the_midpoint() -> None:
    """Steps 0-5 at 256 tokens of 1000 FLOPs, then 512 tokens of 2000 FLOPs: step 5.2 has 5 x 256 + 0.2 x 512 tokens
    and 5 x 256 x 1000 + 0.2 x 512 x 2000 FLOPs."""
    stages = [{"from_step": 0, "tokens_per_step": 256, "flops_per_token": 1000.0},
              {"from_step": 5, "tokens_per_step": 512, "flops_per_token": 2000.0}]
    assert through(stages, 5.2) == pytest.approx((1382.4, 1_484_800.0))
    assert through(stages, 3.7) == pytest.approx((3.7 * 256, 3.7 * 256 * 1000.0))
    got = run_targets({**SUMMARY, "stages": stages}, [3.24])[0]
    assert got["tokens_to_target"] == pytest.approx(1382.4) and got["flops_to_target"] == pytest.approx(1_484_800.0)
