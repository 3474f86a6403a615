"""A run's steps, tokens, FLOPs and time to its own target val losses (train.yaml's `targets:`, lmlab.record.targets):
worked
out by hand on a val curve in optimizer steps, refused by key when they are not val losses, and, end to end, the same
numbers in summary.json, in the W&B run's summary read back with W&B's own reader, and in `eval.py compare=`."""

from __future__ import annotations

import pytest

from lmlab import compose
from lmlab.record.targets import TARGET_FIGURES, check_targets, run_targets, run_wall, wandb_keys
from lmlab.run.checks import check_config

# Validations after 4, 8 and 12 optimizer steps (null: a non-finite loss), 256 tokens a step, 1000 FLOPs a token;
# the run was resumed once: 7 s, then 5 s.
SUMMARY = {"val_curve": [[4, 3.3], [8, 3.1], [10, None], [12, 2.9]], "steps": 12, "tokens": 3072,
           "flops_per_token": 1000.0, "wall_time_s": 5.0,
           "attempts": [{"status": "interrupted", "wall_time_s": 7.0}, {"status": "completed", "wall_time_s": 5.0}]}


def test_to_target_by_hand_on_the_val_curve() -> None:
    got = {t["target"]: t for t in run_targets(SUMMARY, [3.2, 3.5, 2.0])}
    # 3.2 lies between 3.3 (step 4) and 3.1 (step 8): step 4 + 0.1/0.2·4 = 6, 6 steps of 256 tokens, 12 s·6/12
    assert got[3.2] == pytest.approx({"target": 3.2, "steps_to_target": 6.0, "tokens_to_target": 1536.0,
                                      "flops_to_target": 1.536e6, "time_to_target_s": 6.0})
    assert got[3.5]["steps_to_target"] == 4.0 and got[3.5]["time_to_target_s"] == pytest.approx(4.0)  # at once
    assert got[2.0] == {"target": 2.0, **dict.fromkeys(TARGET_FIGURES)}  # never reached
    assert run_wall(SUMMARY) == 12.0 and run_wall({"wall_time_s": 5.0}) == 5.0  # every attempt's time counts
    assert run_targets(SUMMARY, []) == []


def test_wandb_names_are_letters_digits_and_underscores() -> None:
    keys = wandb_keys(run_targets(SUMMARY, [3.2, 2.0]))
    assert keys["steps_to_target_3p2"] == pytest.approx(6.0) and keys["time_to_target_s_3p2"] == pytest.approx(6.0)
    assert keys["tokens_to_target_2"] is None and len(keys) == 8
    assert all(k.replace("_", "a").isalnum() for k in keys)  # W&B sorts and filters only such names


@pytest.mark.parametrize("bad", ["[0]", "[-1.5]", "[nan]", "[abc]", "2.5"])
def test_targets_that_are_not_val_losses_are_refused_by_key(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^targets="):
        check_config(compose([f"targets={bad}"]))
    assert check_targets([2.5, 2]) == [2.5, 2.0] and check_targets(None) == []
