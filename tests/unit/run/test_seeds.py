"""The seed split (issue 62): `seeds.init`, `seeds.data` and `seeds.dropout`, each `seed` unless set (lmlab.run.seeds).
With none set a run is the one `seed` alone made before the split (the dropout stream not reseeded); a bad value or an
unknown seed is refused naming the key; a run's recorded config gives its effective seeds, an old one's from its
`seed`, and read as a config gives them again; the dropout stream's reseed is a pure function of its seed and the step
it starts at."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

from lmlab import compose
from lmlab.run.checks import check_config
from lmlab.run.seeds import Seeds, dropout_key, effective, record, recorded, reseed_training


@pytest.mark.parametrize("overrides, seeds", [
    ([], Seeds(init=1337, data=1337, dropout=None)),  # today's run: the dropout stream follows the init's
    (["seed=7"], Seeds(init=7, data=7, dropout=None)),
    (["seed=7", "seeds.data=2"], Seeds(init=7, data=2, dropout=None)),  # one init, one dropout stream, another order
    (["seed=7", "seeds.init=3"], Seeds(init=3, data=7, dropout=None)),  # the dropout stream follows the init's
    (["seed=7", "seeds.dropout=0"], Seeds(init=7, data=7, dropout=0)),
    (["seeds.init=1", "seeds.data=2", "seeds.dropout=3"], Seeds(init=1, data=2, dropout=3)),
])
def test_each_seed_is_seed_unless_set(overrides: list[str], seeds: Seeds) -> None:
    assert effective(compose(overrides)) == seeds


@pytest.mark.parametrize("override, refusal", [
    ("seeds.data=-1", r"^seeds\.data=-1 must be an integer in \[0, 4\.29497e\+09\] or null"),
    (f"seeds.init={2**32}", r"^seeds\.init=4294967296 must be"),
    ("seeds.dropout=abc", r"^seeds\.dropout='abc' must be"),
    ("seeds.init=true", r"^seeds\.init=True must be"),
    ("seeds.data=1.5", r"^seeds\.data=1\.5 must be"),
    ("+seeds.order=1", r"^seeds\.order: there is no such seed; the seeds are seeds\.init, seeds\.data, seeds\.dropout"),
])
def test_a_bad_seed_is_refused_naming_its_key(override: str, refusal: str) -> None:
    with pytest.raises(ValueError, match=refusal):
        check_config(compose([override]))


@pytest.mark.parametrize("override", ["seeds.init=0", f"seeds.data={2**32 - 1}", "seeds.dropout=null"])
def test_a_seeds_bounds_and_null_are_accepted(override: str) -> None:
    check_config(compose([override]))


def test_a_runs_recorded_config_gives_its_seeds() -> None:
    assert recorded({"seed": 3}) == Seeds(3, 3, None)  # a run from before the split
    assert recorded({"seed": 3, "seeds": {"init": 1, "data": 2, "dropout": None}}) == Seeds(1, 2, None)
    assert recorded({"seed": 3, "seeds": {"init": 1, "data": 2, "dropout": 3}}) == Seeds(1, 2, 3)
    for overrides in ([], ["seeds.init=3"], ["seed=7", "seeds.data=2", "seeds.dropout=4"]):  # the record round-trips
        cfg = compose(overrides)
        record(cfg, effective(cfg))
        assert effective(cfg) == effective(compose(overrides)) == recorded(OmegaConf.to_container(cfg))
    for damaged in (None, {}, {"seed": "3"}, {"seed": True}, {"seed": 3, "seeds": {"init": -1}},
                    {"seed": 3, "seeds": 4}):
        assert recorded(damaged) is None, damaged


def test_the_dropout_stream_is_reseeded_only_when_it_has_its_own_seed() -> None:
    torch.manual_seed(11)
    torch.randn(5)
    before = torch.get_rng_state()
    assert reseed_training(Seeds(1, 2, None)) is None  # no seeds.* set: the init's stream goes on, as before the split
    assert torch.equal(torch.get_rng_state(), before)
    key = reseed_training(Seeds(1, 2, 5))
    first = torch.randn(8)
    torch.manual_seed(99)  # whatever the init drew before it
    assert reseed_training(Seeds(4, 6, 5)) == key  # another init and data seed: the same dropout stream
    assert torch.equal(torch.randn(8), first)
    assert key == dropout_key(5, 0) and len({dropout_key(5, 0), dropout_key(5, 10), dropout_key(6, 0), 5}) == 4
    assert 0 <= key < 2**32
