"""tests/composed.py: a config composed again in a worker is a copy of the first composition, equal to what Hydra
composes, and the test's own to change."""

from __future__ import annotations

import os

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

import lmlab
from tests.composed import once_per_config

REAL = getattr(lmlab.compose, "__wrapped__", lmlab.compose)  # Hydra's composition, each call


def counted():
    calls = []

    def compose(overrides=None, config_name="train"):
        calls.append((config_name, list(overrides or [])))
        return REAL(overrides, config_name)

    return once_per_config(compose), calls


def test_the_tests_compose_once_per_config_unless_switched_off() -> None:
    if os.environ.get("LMLAB_TEST_COMPOSE_CACHE") == "0":
        assert not hasattr(lmlab.compose, "composed")
    else:
        assert isinstance(lmlab.compose.composed, dict) and lmlab.compose.__wrapped__ is REAL


def test_a_second_composition_is_an_equal_copy_of_its_own() -> None:
    compose, calls = counted()
    args = ["optim=soap", "model.n_layer=3", "schedule.warmup_steps=${trainer.max_steps}"]
    first, second = compose(args), compose(list(args))
    assert calls == [("train", args)]  # Hydra composed once
    assert first is not second and first == second == REAL(args)
    assert OmegaConf.is_struct(second) and second.schedule.warmup_steps == second.trainer.max_steps
    second.optim.lr = 1.0  # a test changes its copy: the next copy is the composition's
    second.trainer.max_steps = 7
    third = compose(args)
    assert third.optim.lr == first.optim.lr != 1.0 and third.schedule.warmup_steps == first.trainer.max_steps != 7
    with pytest.raises(Exception, match="no_such_key"):  # the flags are copied too: struct refuses a new key
        third.no_such_key = 1


def test_other_overrides_or_another_config_compose_again() -> None:
    compose, calls = counted()
    assert compose(["optim=lion"]).optim.name == "lion" and compose(["optim=adamw"]).optim.name == "adamw"
    assert "trainer" not in compose([], "eval") and "trainer" in compose([])
    assert calls == [("train", ["optim=lion"]), ("train", ["optim=adamw"]), ("eval", []), ("train", [])]


def test_a_composition_that_fails_is_not_kept_and_fails_again() -> None:
    compose, calls = counted()
    for _ in range(2):
        with pytest.raises(ConfigCompositionException, match="optim"):
            compose(["optim=no_such_optimizer"])
    assert len(calls) == 2 and compose.composed == {}
