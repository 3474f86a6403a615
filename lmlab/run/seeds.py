"""A run's three seeds: `seeds.init` (the weights), `seeds.data` (the training order, a task's sampling, head=mlm's
masks), each `seed` unless set, and `seeds.dropout` (the random draws of training: dropout and anything else that reads
the global RNGs), the init's stream unless set: a seed study can vary the init with the data order fixed, or the order
with the weights fixed.

`seed` stays a scalar (Hydra cannot make one key both a number and a group), so `seed=N` means what it meant before
the split, bit for bit: with no `seeds.*` key set the RNGs are seeded with `seed` before the model is built and
training's draws continue that stream, and the data order is a function of `seed`. The rules (`effective`):

- `seeds.init` (null: `seed`): the global RNGs are seeded with it before the model is built, where `seed` was.
- `seeds.data` (null: `seed`): the data module's seed and head=mlm's mask key (lmlab.data, LitGPT.prepare).
- `seeds.dropout` (null: the init's stream): set, the global RNGs are reseeded at the start of training from (this
  seed, DROPOUT_STREAM, the step the attempt starts at), so training's draws no longer depend on the init. Null, they
  go on from the init's stream as before the split (a reseed from `seed` could not be: the init's draws come first in
  that stream), so they change with `seeds.init`: a study of init luck with the dropout masks fixed sets
  seeds.dropout. Only dropout (model.dropout > 0) and layer drop draw from it in training.

The effective seeds (init and data as integers, dropout as its seed or null: "follows the init") are written into the
run's effective config, so `.hydra/config.yaml` and summary.json's `config.seeds` record them, and the record read as
a config gives the same seeds again. A resume re-derives them from its own command:
a different data seed is warned about by the data module (the order no longer continues the checkpoint's, as for
`seed` before the split), the init is the checkpoint's weights whatever `seeds.init` says, and the dropout stream
restarts at the resume (it was never saved).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Annotated, Any

from omegaconf import DictConfig, OmegaConf, open_dict

from lmlab.registry import Range, check_values

SEED_RANGE = Annotated[int, Range(ge=0, le=2**32 - 1)]  # numpy's bounds (lmlab seeds numpy with each)
KEYS = ("init", "data", "dropout")
OVERRIDES = ("seed", *(f"seeds.{k}" for k in KEYS))  # the keys that only reseed a run: a variant's runs differ by them
DROPOUT_STREAM = 0x64726F70  # "drop": the dropout stream's key apart from any seed's own stream


@dataclass(frozen=True)
class Seeds:
    init: int
    data: int
    dropout: int | None  # None: training's draws continue the init's stream

    def as_dict(self) -> dict[str, int | None]:
        return asdict(self)


def given(cfg: DictConfig | Mapping[str, Any]) -> dict[str, Any]:
    """The `seeds` mapping as the config sets it ({} when it has none: a config from before the split)."""
    spec = cfg.get("seeds")
    if spec is None:
        return {}
    if isinstance(spec, DictConfig):
        spec = OmegaConf.to_container(spec, resolve=True)
    if not isinstance(spec, Mapping):
        raise ValueError(f"seeds={spec!r} must be a mapping of {', '.join(KEYS)} (e.g. seeds.data=2); "
                         f"`seed` is the one seed they derive from")
    return dict(spec)


def check(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Refuse, naming the key, a `seeds.*` key lmlab does not know or a value that is not a seed (an integer in
    [0, 2**32 - 1]) or null."""
    spec = given(cfg)
    if unknown := sorted(set(spec) - set(KEYS)):
        raise ValueError(f"seeds.{unknown[0]}: there is no such seed; the seeds are "
                         f"{', '.join(f'seeds.{k}' for k in KEYS)}")
    check_values("seeds.", spec, {k: SEED_RANGE | None for k in KEYS})


def effective(cfg: DictConfig | Mapping[str, Any]) -> Seeds:
    """The seeds a run with `cfg` uses (the module docstring's rules)."""
    spec, seed = given(cfg), int(cfg.get("seed", 0))
    init, data, dropout = (spec.get(k) for k in KEYS)
    return Seeds(init=seed if init is None else int(init), data=seed if data is None else int(data),
                 dropout=None if dropout is None else int(dropout))


def record(cfg: DictConfig, seeds: Seeds) -> None:
    """Write the effective seeds into `cfg` (the run's effective config: what .hydra/config.yaml and summary.json
    record)."""
    with open_dict(cfg):
        cfg.seeds = seeds.as_dict()


def recorded(config: Mapping[str, Any] | None) -> Seeds | None:
    """The effective seeds of a run from its recorded config (summary.json's `config`): its `seeds` where it wrote
    them, else (a run from before the split) derived from its `seed`; None without a seed."""
    if not isinstance(config, Mapping) or isinstance(config.get("seed"), bool) or not isinstance(
            config.get("seed"), int):
        return None
    try:
        check(config)
        return effective(config)
    except ValueError:  # a damaged record: not one of lmlab's
        return None


def dropout_key(seed: int, step: int = 0) -> int:
    """The seed the global RNGs get at the start of training from `seeds.dropout` (and the step the attempt starts at,
    so a resumed run does not replay the masks of its first steps)."""
    import numpy as np

    return int(np.random.SeedSequence([seed, DROPOUT_STREAM, step]).generate_state(1)[0])


def reseed_training(seeds: Seeds, step: int = 0) -> int | None:
    """Reseed the global RNGs for training from `seeds.dropout` (None: left as they are, continuing the init's
    stream); returns the seed given to them. Lightning's `seed_everything` also sets PL_GLOBAL_SEED, which DDP and
    FSDP reseed from when they set up: their ranks then draw from this stream too."""
    if seeds.dropout is None:
        return None
    from lightning.fabric.utilities.seed import seed_everything

    return seed_everything(dropout_key(seeds.dropout, step), workers=True, verbose=False)
