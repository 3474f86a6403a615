"""The run's own keys a user can get wrong, refused (or warned about) by key before anything is imported or written
(issue 59's Low items): the seed's bounds, a log interval of 0, a precision Lightning does not know, a head untied after
the run ends, and a key of thousands of characters."""

from __future__ import annotations

import typing
import warnings

import pytest

from lmlab import compose
from lmlab.commands.refusals import unknown_override
from lmlab.run.checks import PRECISIONS, check_config


@pytest.mark.parametrize("override, refusal", [
    ("seed=-1", r"^seed=-1 must be"), (f"seed={2**32}", r"^seed=4294967296 must be"),
    ("trainer.log_every_n_steps=0", r"^trainer\.log_every_n_steps=0 must be"),
    ("trainer.precision=bogus", r"^trainer\.precision='bogus' is not a precision Lightning knows"),
    ("trainer.precision=true", r"^trainer\.precision=True is not a precision"),
])
def test_a_bad_run_key_is_refused_naming_it(override: str, refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        check_config(compose([override]))


@pytest.mark.parametrize("override", ["seed=0", f"seed={2**32 - 1}", "trainer.log_every_n_steps=1",
                                      "trainer.precision=bf16-mixed", "trainer.precision=32"])
def test_their_bounds_are_accepted(override: str) -> None:
    check_config(compose([override]))


def test_lmlabs_precisions_are_lightnings() -> None:
    from lightning.fabric.connector import _PRECISION_INPUT

    def flat(tp: typing.Any) -> list[typing.Any]:
        args = typing.get_args(tp)
        return [x for a in args for x in flat(a)] if args else [tp]

    assert sorted(map(str, PRECISIONS)) == sorted(map(str, flat(_PRECISION_INPUT)))


def test_a_head_untied_after_the_last_step_is_warned_about() -> None:
    cfg = compose(["model.tie_embeddings=true", "model.untie_at_step=700", "trainer.max_steps=600"])
    with pytest.warns(UserWarning, match=r"model\.untie_at_step=700 >= trainer\.max_steps=600: the head stays tied"):
        check_config(cfg)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="model.untie_at_step")
        check_config(compose(["model.tie_embeddings=true", "model.untie_at_step=300", "trainer.max_steps=600"]))


def test_a_key_of_thousands_of_characters_is_an_unknown_key_not_a_traceback() -> None:
    key = "a" * 5000
    assert unknown_override("train", [f"{key}=1"]).startswith(f"{key}=1: there is no config group or key")
