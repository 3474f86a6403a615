"""`lmlab sweep status|resume` on a sweep of the default launcher (each job in the submitting process): the submitter
killed mid-way, the status read from another process, a drifted base config refused naming the key, the resume that
ends with the uninterrupted sweep's metrics.csv, a second resume that does nothing, and more steps for every job."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lmlab.record import sweep
from tests.e2e.run.test_interrupt import figures
from tests.runs import ROOT, cli, tiny

LONG = ("trainer.max_steps=600", "trainer.val_check_interval=100", "trainer.log_every_n_steps=10")


def sweep_command(corpus: Path, sweep_dir: Path) -> list[str]:
    return [sys.executable, str(ROOT / "train.py"), "-m", *tiny(corpus, sweep_dir.parent / "cache", *LONG),
            "placement=pre,post", f"hydra.sweep.dir={sweep_dir}"]


def lmlab_sweep(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return cli("-m", "lmlab", "sweep", *args, cwd=cwd)


def runs(sweep_dir: Path) -> dict[str, list[dict[str, str]]]:
    """{the job's placement: its metrics.csv rows}."""
    manifest = sweep.read(sweep_dir)
    return {next(o for o in j["overrides"] if o.startswith("placement=")): figures(sweep_dir / j["dir"])
            for j in manifest["jobs"]}


@pytest.fixture(scope="module")
def uninterrupted(corpus: Path, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("uninterrupted") / "sweep"
    result = subprocess.run(sweep_command(corpus, d), cwd=d.parent, capture_output=True, text=True, timeout=600,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return d


def test_a_sweep_killed_midway_resumes_to_the_uninterrupted_results(corpus: Path, tmp_path: Path,
                                                                     uninterrupted: Path) -> None:
    d = tmp_path / "sweep"
    proc = subprocess.Popen(sweep_command(corpus, d), cwd=tmp_path, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.time() + 300
        while time.time() < deadline:  # the second job mid-way
            rows = sweep.job_states(d) if sweep.path_of(d).is_file() else []
            if len(rows) == 2 and rows[1]["state"] == "running" and (rows[1]["step"] or 0) >= 200:
                break
            assert proc.poll() is None, "the sweep ended before it was killed"
            time.sleep(0.2)
        else:
            raise AssertionError("the second job did not reach step 200")
    finally:
        proc.kill()  # SIGKILL: the submitter and the job it runs, no summary written
        proc.wait()

    status = lmlab_sweep("status", str(d), "--json", cwd=tmp_path)  # from another process, the submitter dead
    assert status.returncode == 0, status.stderr
    jobs = json.loads(status.stdout)["jobs"]
    assert [(j["state"], j["attempts"], j["max_steps"]) for j in jobs] == [("completed", 1, 600),
                                                                              ("lost", 1, 600)], jobs
    assert 200 <= jobs[1]["step"] < 600 and jobs[1]["val_loss"] is not None
    table = lmlab_sweep("status", str(d), cwd=tmp_path).stdout
    assert "placement=post  lost" in table and "2 job(s): 1 completed, 1 lost" in table, table

    manifest = json.loads(sweep.path_of(d).read_text())
    drifted = json.loads(json.dumps(manifest))
    drifted["base_config"]["optim"]["lr"] = 1.0  # as if a default had changed since the sweep started
    sweep.path_of(d).write_text(json.dumps(drifted))
    refused = lmlab_sweep("resume", str(d), cwd=tmp_path)
    assert refused.returncode == 2 and "optim.lr: 1.0 -> " in refused.stderr, refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr and json.loads(lmlab_sweep("status", str(d), "--json", cwd=tmp_path)
                                                            .stdout)["jobs"][1]["state"] == "lost"
    sweep.path_of(d).write_text(json.dumps(manifest))

    resumed = lmlab_sweep("resume", str(d), cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "1 job(s) to run: #1 (lost)" in resumed.stdout
    assert runs(d) == runs(uninterrupted)  # row for row, perf/ aside: the resumed job as if never killed
    mtimes = sorted(p.stat().st_mtime_ns for p in d.glob("*/metrics.csv"))
    again = lmlab_sweep("resume", str(d), cwd=tmp_path)
    assert again.returncode == 0 and "nothing to resume" in again.stdout and "(2 completed)" in again.stdout
    assert sorted(p.stat().st_mtime_ns for p in d.glob("*/metrics.csv")) == mtimes

    longer = lmlab_sweep("resume", str(d), "trainer.max_steps=700", cwd=tmp_path)  # the drift meant
    assert longer.returncode == 0, longer.stderr[-3000:]
    jobs = json.loads(lmlab_sweep("status", str(d), "--json", cwd=tmp_path).stdout)["jobs"]
    assert [(j["state"], j["step"], j["max_steps"]) for j in jobs] == [("completed", 700, 700)] * 2
    assert len(list(d.glob("*/summary.json"))) == 2  # the same two directories, continued


def test_lmlab_compare_over_two_sweeps_aggregates_the_seeds_and_pairs_them(corpus: Path, tmp_path: Path) -> None:
    """A baseline sweep and a new one (placement=pre and placement=post, 2 seeds each) through the real commands:
    `lmlab compare A B` is one table with the sweep as a key, a row per variant over its seeds, the paired verdict."""
    for name, placement in (("baseline", "pre"), ("new", "post")):
        res = cli(str(ROOT / "train.py"), "-m", *tiny(corpus, tmp_path / "cache"), f"placement={placement}",
                  "seed=1,2", f"hydra.sweep.dir={tmp_path / name}", cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
    res = cli("-m", "lmlab", "compare", str(tmp_path / "baseline"), str(tmp_path / "new"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = tmp_path / "baseline" / "vs_new"
    with open(out / "compare_variants.csv") as f:
        variants = {(r["sweep"], r["placement"]): r for r in csv.DictReader(f)}
    assert set(variants) == {("baseline", "pre"), ("new", "post")}
    assert all(v["n"] == "2" and v["seeds"] == "1,2" for v in variants.values())
    with open(out / "compare_significance.csv") as f:
        (pair,) = csv.DictReader(f)
    assert pair["variant"] == "sweep=new,placement=post" and pair["baseline"] == "sweep=baseline,placement=pre"
    assert pair["distinguishable"] and "Paired against the baseline" in res.stdout
    assert f"-> {out}/compare.md" in res.stdout
