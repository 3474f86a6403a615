"""The fixed-budget mode as a script or an agent drives it (issue 62): `python train.py budget.wall=s ledger=<file>`
stops within 5% of its wall budget with the schedule decayed to its floor, prints one `LEDGER {...}` line, its last,
equal to the row it appends; a diverged run and a refused one leave their rows too; 8 processes appending 50 rows
each at once leave 400 whole lines."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmlab.record import ledger as ledger_file
from tests.runs import ROOT, cli, metric, tiny


def _printed(stdout: str) -> dict:
    """The run's LEDGER line: stdout's last line."""
    last = stdout.rstrip("\n").splitlines()[-1]
    assert last.startswith(ledger_file.PREFIX), stdout[-2000:]
    return json.loads(last[len(ledger_file.PREFIX):])


def test_a_wall_budget_run_stops_at_its_budget_and_leaves_one_row(corpus: Path, tmp_path: Path) -> None:
    wall, ledger, run = 10.0, tmp_path / "runs.jsonl", tmp_path / "run"
    res = cli(str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache", f"budget.wall={wall}", f"ledger={ledger}",
                                            "trainer.val_check_interval=50", "trainer.max_steps=5",
                                            "schedule.warmup_steps=3"),
              f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows, bad = ledger_file.read(ledger)
    assert bad == [] and len(rows) == 1 and _printed(res.stdout) == rows[0]
    row = rows[0]
    assert row["status"] == "completed" and row["run_dir"] == str(run) and f"ledger={ledger}" in row["overrides"]
    summary = json.loads((run / "summary.json").read_text())
    assert (row["val_loss"], row["tokens"], row["params"], row["steps"]) == (
        summary["final_val_loss"], summary["tokens"], summary["n_params"], summary["steps"])
    assert row["flops"] == summary["budget_spent"]["flops"] > 0 and row["peak_memory_gib"] > 0
    assert row["commit"] is None or len(row["commit"]) == 40
    # the budget: the trainer's clock stopped within 5% of it, at the horizon fitted to it (whatever trainer.max_steps
    # says: 5 here), and the cosine reached its floor there (min_lr_ratio 0.1 of optim.lr)
    spent = row["budget"]
    assert spent["kind"] == "wall" and 0.95 * wall <= spent["trained_s"] <= 1.05 * wall, spent
    assert spent["steps"] > 50 and row["steps"] >= 0.95 * spent["steps"], spent
    lr = metric(run, "lr")
    assert lr[max(lr)] <= 0.15 * max(lr.values()), (lr[max(lr)], max(lr.values()))


def test_a_diverged_run_writes_its_row(corpus: Path, tmp_path: Path) -> None:
    ledger = tmp_path / "runs.jsonl"
    res = cli(str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache", "optim.lr=1e3", "optim.grad_clip=0",
                                            "schedule.warmup_steps=0", "divergence.min_steps=2", f"ledger={ledger}"),
              f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]  # a divergence is a result
    rows, _ = ledger_file.read(ledger)
    assert [r["status"] for r in rows] == ["diverged"] and _printed(res.stdout) == rows[0]
    assert rows[0]["steps"] < 30


@pytest.mark.parametrize("bad, said", [("optim.lr=abc", "optim.lr"), ("optim.lrr=1", "optim has no key 'lrr'")])
def test_a_refused_run_writes_its_row_and_exits_2(tmp_path: Path, bad: str, said: str) -> None:
    ledger = tmp_path / "runs.jsonl"
    res = cli(str(ROOT / "train.py"), bad, f"ledger={ledger}", "logger=none", f"hydra.run.dir={tmp_path / 'run'}",
              cwd=tmp_path)
    assert res.returncode == 2 and said in res.stderr, res.stderr[-3000:]
    rows, _ = ledger_file.read(ledger)
    assert len(rows) == 1 and rows[0]["status"] == "refused" and said in rows[0]["error"], rows
    assert rows[0]["val_loss"] is None and bad in rows[0]["overrides"] and _printed(res.stdout) == rows[0]
    assert not (tmp_path / "run" / "summary.json").exists()


APPENDER = """
import sys, time
from lmlab.record.ledger import append
who, path, start = sys.argv[1], sys.argv[2], float(sys.argv[3])
while time.time() < start:
    pass
for i in range(50):
    append(path, {"status": "completed", "who": who, "i": i, "pad": who * 6000})  # past PIPE_BUF: no free atomicity
"""


def test_eight_processes_appending_at_once_leave_400_whole_rows(tmp_path: Path) -> None:
    path, start = tmp_path / "runs.jsonl", time.time() + 3.0
    procs = [subprocess.Popen([sys.executable, "-c", APPENDER, str(w), str(path), str(start)], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True) for w in range(8)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, errors
    lines = path.read_text().split("\n")
    assert lines[-1] == "" and len(lines) == 401
    rows = [json.loads(line) for line in lines[:-1]]
    assert sorted((r["who"], r["i"]) for r in rows) == sorted((str(w), i) for w in range(8) for i in range(50))
    assert all(r["pad"] == r["who"] * 6000 for r in rows)
