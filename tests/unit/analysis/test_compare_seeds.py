"""compare's seeds section (issue 62, the seed split): for each variant of several runs, which of its seeds varied —
init luck, data-order luck or both (`seed`) — read from each run's recorded seeds (an old run's from its `seed`), the
seed keys never telling variants apart, and a note when two variants' spreads vary different seeds."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from lmlab.analysis import compare_seeds  # noqa: F401  (registers its section)
from lmlab.analysis.compare import compare
from lmlab.analysis.compare_seeds import seed_label, spread, varied
from lmlab.run.seeds import Seeds


def _run(sweep: Path, overrides: list[str], config: dict, loss: float = 2.0) -> None:
    run = sweep / ",".join(overrides)
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps({
        "status": "completed", "steps": 10, "overrides": overrides, "final_val_loss": loss, "best_val_loss": loss,
        "unigram_val_loss": 3.0, "config": config}))


def _rows(path: Path) -> dict[str, dict[str, str]]:
    with open(path) as f:
        return {r["variant"]: r for r in csv.DictReader(f)}


def _config(seed: int = 1337, init: int | None = None, data: int | None = None, dropout: int | None = None) -> dict:
    """A run's recorded config as lmlab.run.plan writes it: the effective seeds."""
    return {"seed": seed, "seeds": {"init": seed if init is None else init, "data": seed if data is None else data,
                                    "dropout": dropout}}


def test_each_variant_says_which_of_its_seeds_varied(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for i in (1, 2, 3):
        _run(sweep, ["ffn=mlp", f"seeds.data={i}"], _config(data=i), 2.0 + i / 100)  # one init, three orders
        _run(sweep, ["ffn=glu", f"seeds.init={i}"], _config(init=i), 2.1 + i / 100)  # three inits, one order
        _run(sweep, ["ffn=moe", f"seed={i}"], _config(seed=i), 2.2 + i / 100)  # `seed`: everything moves
        _run(sweep, ["ffn=gau", f"seeds.init={i}", "seeds.dropout=5"], _config(init=i, dropout=5))
    _, md = compare(sweep)
    rows = _rows(sweep / "compare_seeds.csv")
    assert rows["ffn=mlp"] == {"variant": "ffn=mlp", "runs": "3", "init": "1337", "data": "1,2,3",
                                "dropout": "follows init", "varied": "data", "spread": "data-order luck"}
    assert rows["ffn=glu"]["init"] == "1,2,3" and rows["ffn=glu"]["data"] == "1337"
    assert rows["ffn=glu"]["varied"] == "init, dropout (follows init)"  # no seeds.dropout: the masks follow the init
    assert rows["ffn=glu"]["spread"] == "init and dropout luck"
    assert rows["ffn=gau"]["varied"] == "init" and rows["ffn=gau"]["dropout"] == "5"  # the masks held fixed
    assert rows["ffn=moe"]["varied"] == "seed (init, data, dropout)"
    assert rows["ffn=moe"]["spread"] == "init, data-order and dropout luck together (`seed` moves them all)"
    assert "Seeds per variant" in md and "| ffn=mlp |" in md
    notes = [line for line in md.splitlines() if line.startswith("Note: the variants' spreads vary different seeds")]
    assert len(notes) == 1 and "ffn=mlp: data" in notes[0] and "ffn=gau: init" in notes[0]


def test_runs_from_before_the_split_read_their_seed(tmp_path: Path) -> None:
    """A run recorded before the split has `seed` and no `seeds`: init and data are its seed, the dropout stream its
    init's. A sweep over `seed` alone: one kind of spread, so no note; a variant of one run has no row."""
    sweep = tmp_path / "sweep"
    for i in (1, 2):
        _run(sweep, ["norm=rms", f"seed={i}"], {"seed": i})
    _run(sweep, ["norm=layer", "seed=1"], {"seed": 1})
    _, md = compare(sweep)
    rows = _rows(sweep / "compare_seeds.csv")
    assert set(rows) == {"norm=rms"}
    assert rows["norm=rms"]["init"] == rows["norm=rms"]["data"] == "1,2"
    assert rows["norm=rms"]["varied"] == "seed (init, data, dropout)"
    assert "spreads vary different seeds" not in md


def test_no_variant_of_several_runs_adds_no_section(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    _run(sweep, ["norm=rms"], _config())
    _run(sweep, ["norm=layer"], _config())
    _, md = compare(sweep)
    assert not (sweep / "compare_seeds.csv").exists() and "Seeds per variant" not in md


def test_what_varied_and_the_label_that_pairs_runs() -> None:
    assert varied([Seeds(1, 2, None), Seeds(1, 3, None)]) == ["data"]
    assert varied([Seeds(1, 2, None), Seeds(4, 2, None)]) == ["init", "dropout"]  # the masks follow the init
    assert varied([Seeds(1, 2, 7), Seeds(4, 2, 7)]) == ["init"]
    assert varied([Seeds(1, 2, 7), Seeds(1, 2, None)]) == ["dropout"]  # its own stream against the init's
    assert varied([Seeds(1, 2, None), Seeds(1, 2, None)]) == [] and spread([]).startswith("none")
    assert seed_label({"seed": "3", "ffn": "glu"}) == "3"  # what compare's seeds column always showed
    assert seed_label({"seed": "3", "seeds.data": "2"}) == "seed=3 seeds.data=2"
    assert seed_label({"seeds.init": "4", "seed": ""}) == "seeds.init=4" and seed_label({"ffn": "glu"}) == ""


def test_the_seed_keys_never_tell_variants_apart(tmp_path: Path) -> None:
    """A sweep over seeds.data: one variant per architecture in compare_variants (the seeds column naming each run's),
    each paired against the baseline over the data seeds both have."""
    sweep = tmp_path / "sweep"
    for i in (1, 2, 3):
        _run(sweep, ["ffn=mlp", f"seeds.data={i}"], _config(data=i), 2.0 + i / 100)
        _run(sweep, ["ffn=glu", f"seeds.data={i}"], _config(data=i), 2.1 + i / 100 + (i == 2) / 1000)
    compare(sweep, baseline="mlp")
    with open(sweep / "compare_variants.csv") as f:
        variants = {r["ffn"]: r for r in csv.DictReader(f)}
    assert set(variants) == {"mlp", "glu"} and variants["glu"]["n"] == "3"
    assert variants["glu"]["seeds"] == "seeds.data=1,seeds.data=2,seeds.data=3"
    with open(sweep / "compare_significance.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert row["variant"] == "ffn=glu" and row["n"] == "3"  # paired over the three data seeds
    assert float(row["diff_mean"]) == pytest.approx(0.1 + 0.001 / 3)
