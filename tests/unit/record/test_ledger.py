"""The results ledger of fixed-budget loops (`ledger=<file>`, lmlab.record.ledger) and `lmlab ledger <file>`
(lmlab.analysis.ledger): a row made from a run's summary, appended whole as one JSON line, hand-edited lines reported
and skipped, the table best first with each row's difference to the best and the noise floor worked out by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lmlab.analysis.ledger import ranked
from lmlab.commands import main
from lmlab.record import ledger

SUMMARY = {"status": "completed", "steps": 30, "tokens": 7680, "final_val_loss": 2.25, "final_val_bpb": 3.1,
           "n_params": 41_000, "budget_spent": {"tokens": 7680, "flops": 1.5e9, "wall_s": 4.0}, "mfu": None,
           "wall_time_s": 4.5, "overrides": ["norm=rms", "seed=3"], "error": None, "config": {"seed": 3},
           "budget": {"kind": "wall", "value": 5.0, "steps": None}, "diverged_at_step": None}


def test_a_row_holds_the_runs_figures_by_the_ledgers_names() -> None:
    row = ledger.row("completed", summary=SUMMARY, run_dir="/runs/a", overrides=["norm=rms", "seed=3"],
                     code=("abc123", None), peak_memory_gib=0.5, horizon={"horizon": 40, "trained_s": 4.9})
    assert {k: row[k] for k in ("status", "val_bpb", "val_loss", "params", "tokens", "flops", "mfu",
                                "peak_memory_gib", "wall_s", "steps", "commit", "dirty", "seed", "overrides",
                                "run_dir", "error")} == {
        "status": "completed", "val_bpb": 3.1, "val_loss": 2.25, "params": 41_000, "tokens": 7680, "flops": 1.5e9,
        "mfu": None, "peak_memory_gib": 0.5, "wall_s": 4.5, "steps": 30, "commit": "abc123", "dirty": None, "seed": 3,
        "overrides": ["norm=rms", "seed=3"], "run_dir": "/runs/a", "error": None}
    assert row["budget"] == {"kind": "wall", "value": 5.0, "steps": 40, "trained_s": 4.9}
    assert list(row)[0] == "status" and isinstance(row["time"], str)
    # strict JSON: a non-finite figure is null; a summary of an older lmlab (no bpb) has val_bpb null
    nan = ledger.row("diverged", summary={**SUMMARY, "final_val_loss": math.nan, "final_val_bpb": None,
                                          "status": "diverged"}, run_dir="r", overrides=[], code=(None, None))
    assert nan["val_loss"] is None and nan["val_bpb"] is None and json.loads(ledger.dumps(nan)) == nan
    refused = ledger.row("refused", run_dir="r", overrides=["optim.lr=abc"], error="optim.lr='abc' must be a number",
                         code=(None, None))
    assert refused["status"] == "refused" and refused["val_loss"] is None and refused["error"].startswith("optim.lr")


def test_rows_append_whole_and_hand_edited_lines_are_reported_not_fatal(tmp_path: Path) -> None:
    path = tmp_path / "deep" / "runs.jsonl"  # its directory is made
    first = {"status": "completed", "val_loss": 2.0, "overrides": ["a=1"]}
    assert ledger.append(path, first) == ledger.dumps(first)
    with open(path, "a") as f:  # a hand edit: a broken line, a list, an object without a status, a blank line and
        f.write('{"status": "compl\n[1, 2]\n{"val_loss": 1.0}\n\n{"status": "failed"}')  # a last line with no "\n"
    ledger.append(path, {"status": "diverged", "overrides": ["b=2"]})  # starts a line of its own
    rows, bad = ledger.read(path)
    assert [r["status"] for r in rows] == ["completed", "failed", "diverged"]
    assert [n for n, _ in bad] == [2, 3, 4]
    assert "not JSON" in bad[0][1] and "not a JSON object" in bad[1][1] and "no status" in bad[2][1]
    assert path.read_text().endswith('{"status": "failed"}\n' + ledger.dumps(rows[-1]) + "\n")


def _row(value: float | None, overrides: list[str], seed: int = 1337, status: str = "completed",
         bpb: float | None = None, commit: str = "c1", error: str | None = None) -> dict:
    return {"status": status, "val_loss": value, "val_bpb": bpb, "overrides": overrides, "seed": seed,
            "commit": commit, "dirty": None, "error": error}


def test_the_table_is_best_first_with_differences_and_the_seed_noise_floor_by_hand() -> None:
    rows = [_row(2.00, ["norm=rms", "seed=1", "ledger=a.jsonl"], 1), _row(2.10, ["norm=layer", "seed=1"], 1),
            _row(2.04, ["norm=rms", "seed=2", "ledger=b.jsonl"], 2), _row(None, ["optim.lr=1e3"], status="diverged"),
            _row(1.99, ["norm=rms", "ffn=swiglu"]), _row(2.02, ["seed=3", "norm=rms"], 3),
            _row(2.14, ["norm=layer", "seed=2"], 2), _row(None, ["optim.lr=abc"], status="refused", error="bad"),
            _row(2.50, ["norm=rms", "seed=4"], 4, commit="c2")]  # the same overrides at another commit: not a repeat
    got = ranked(rows)
    assert got["metric"] == "val_loss"  # no row has val_bpb
    assert [r["val_loss"] for r in got["rows"]] == [1.99, 2.00, 2.02, 2.04, 2.10, 2.14, 2.50]
    assert [r["status"] for r in got["unranked"]] == ["diverged", "refused"]
    # two repeated configs: norm=rms at seeds 1, 2, 3 (2.00, 2.04, 2.02: variance 0.0004, 2 dof) and norm=layer at
    # seeds 1, 2 (2.10, 2.14: variance 0.0008, 1 dof); pooled variance (2 x 0.0004 + 0.0008) / 3
    sigma = math.sqrt((2 * 0.0004 + 0.0008) / 3)
    floor = got["floor"]
    assert floor["sigma"] == pytest.approx(sigma, rel=1e-9) and (floor["configs"], floor["runs"]) == (2, 5)
    assert floor["floor"] == pytest.approx(2 * math.sqrt(2) * sigma, rel=1e-9)  # 0.0653: two sd of a difference
    assert [round(r["diff"], 6) for r in got["rows"]] == [0.0, 0.01, 0.03, 0.05, 0.11, 0.15, 0.51]
    assert [r["above_floor"] for r in got["rows"]] == [None, False, False, False, True, True, True]


def test_bpb_ranks_when_every_row_has_it_and_no_repeats_means_no_floor() -> None:
    rows = [_row(2.0, ["a=1"], bpb=1.20), _row(1.9, ["a=2"], bpb=1.25), _row(2.1, ["a=1"], bpb=1.10)]  # same seed
    got = ranked(rows)
    assert got["metric"] == "val_bpb" and [r["val_bpb"] for r in got["rows"]] == [1.10, 1.20, 1.25]
    assert got["floor"] is None and all(r["above_floor"] is None for r in got["rows"])
    mixed = ranked([*rows, _row(1.5, ["a=3"])])  # one row without bpb: val loss for all
    assert mixed["metric"] == "val_loss" and mixed["rows"][0]["val_loss"] == 1.5


def test_lmlab_ledger_prints_the_table_and_json(tmp_path: Path, capsys) -> None:
    path = tmp_path / "runs.jsonl"
    for r in [_row(2.00, ["norm=rms", "seed=1"], 1), _row(2.10, ["norm=layer"]), _row(2.04, ["norm=rms", "seed=2"], 2),
              _row(None, ["optim.lr=1e3"], status="diverged")]:
        ledger.append(path, r)
    with open(path, "a") as f:
        f.write("garbage\n")
    main(["ledger", str(path)])
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert "ranked by val_loss" in lines[0] and "noise floor 0.0800 " in out  # 2·√2·0.0283 (2.00 and 2.04)
    body = [line for line in lines if line.lstrip().startswith(("1 ", "2 ", "3 "))]
    assert [line.split()[1] for line in body] == ["2.0000", "2.0400", "2.1000"], out  # the metric, best first
    assert "+0.0400" in body[1] and "below" in body[1] and "+0.1000" in body[2] and "above" in body[2], out
    assert "diverged" in out.split("not ranked")[1]
    assert "runs.jsonl:5: skipped: not JSON" in err
    main(["ledger", str(path), "--json"])
    got = json.loads(capsys.readouterr().out)
    assert got["metric"] == "val_loss" and [r["val_loss"] for r in got["rows"]] == [2.00, 2.04, 2.10]
    assert got["bad_lines"] == [{"line": 5, "why": "not JSON (Expecting value)"}]
    with pytest.raises(SystemExit) as stop:
        main(["ledger", str(tmp_path / "none.jsonl")])
    assert stop.value.code == 2 and "none.jsonl does not exist" in capsys.readouterr().err


def test_no_floor_is_said_so_and_the_rows_show_the_overrides_they_do_not_share(tmp_path: Path, capsys) -> None:
    path = tmp_path / "runs.jsonl"
    ledger.append(path, _row(2.0, ["a=1", "b=1"]))
    ledger.append(path, _row(1.9, ["a=1", "b=2"]))
    main(["ledger", str(path)])
    out = capsys.readouterr().out
    assert "no floor (no repeated configs)" in out and "\nevery row: a=1\n" in out, out
    assert [line.split()[-1] for line in out.splitlines()[-2:]] == ["b=2", "b=1"], out
