"""Retrieval across lengths as a user runs it: `python eval.py run=<run> retrieval=... lengths=... ` on a trained
tiny run writes its accuracy per length and depth, refuses a length past the trained one without
allow_extrapolation by key, and `eval.py compare=<sweep>` tabulates each run's accuracy per length."""

from __future__ import annotations

import json
from pathlib import Path

from lmlab import compose
from lmlab.analysis.compare import compare
from lmlab.run.training import train
from tests.runs import ROOT, cli, tiny


def test_eval_py_retrieval_on_a_trained_run_and_the_compare_section(corpus: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for name, extra in (("0_rope", "position=rope"), ("1_nope", "position=none")):
        train(compose(tiny(corpus, tmp_path / "cache", extra, "trainer.max_steps=6", "model.max_seq_len=96")),
              sweep / name)
    run = sweep / "0_rope"
    refused = cli("eval.py", f"run={run}", "retrieval=passkey", "lengths=[128]", cwd=ROOT)
    assert refused.returncode != 0 and "allow_extrapolation" in refused.stderr
    res = cli("eval.py", f"run={run}", "retrieval=multikey", "lengths=[96,128]", "depths=[0.2,0.8]",
              "retrieval_samples=4", "retrieval_keys=2", "allow_extrapolation=true", cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = json.loads((run / "eval_retrieval" / "retrieval.json").read_text())["rows"]
    assert [(r["length"], r["depth"], r["keys"], r["n"]) for r in rows] == [
        (96, 0.2, 2, 4), (96, 0.8, 2, 4), (128, 0.2, 2, 4), (128, 0.8, 2, 4)]
    assert all(r["accuracy"] == 0.0 for r in rows)  # 6 steps: no copying yet
    assert "Retrieval, multikey (2 keys)" in res.stdout and "| 128 |" in res.stdout
    cli("eval.py", f"run={sweep / '1_nope'}", "retrieval=passkey", "retrieval_samples=2", cwd=ROOT)
    _, md = compare(sweep)
    assert "Retrieval (eval.py run=<run> retrieval=...)" in md
    table = (sweep / "compare_retrieval.csv").read_text().splitlines()
    assert table[0] == "variant,family,acc@96,acc@128" and len(table) == 3
