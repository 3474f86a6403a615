"""What lmlab reads back from a run or sweep directory is data, never code (issue 33's Critical): saved overrides with
a `_target_` (top level, nested in a valid value, in one job of a sweep) are refused naming the file and line, with
nothing built or written; every `_target_` the trainer and loggers take is a Lightning or lmlab class of the kind its
place takes, whoever wrote it (a saved file or the command line)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.runs import ROOT, cli, tiny
from tests.unit.record.test_saved_state import _hostile, _write

# --- what users see: the commands -------------------------------------------------------------------------------

def _files(run: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(run)): (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def finished_run(corpus: Path, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("finished")
    res = cli(str(ROOT / "train.py"), *tiny(corpus, d / "cache", "trainer.max_steps=4", "trainer.val_check_interval=2"),
              f"hydra.run.dir={d / 'run'}", cwd=d)
    assert res.returncode == 0, res.stderr[-3000:]
    return d / "run"


@pytest.mark.parametrize("form", ["plugins", "nested_in_strategy", "top_level", "resolver_name_interpolated",
                                  "escaped_interpolation", "task_file", "plus_trainer_key", "newline"])
def test_continuing_a_run_with_hostile_saved_overrides_is_refused_with_nothing_written(
        finished_run: Path, tmp_path: Path, form: str) -> None:
    run, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(finished_run, run)
    saved = run / ".hydra/overrides.yaml"
    lines = OmegaConf.to_container(OmegaConf.load(saved))
    _write(saved, [*lines, _hostile(marker)[form]])
    before = _files(run)
    res = cli(str(ROOT / "train.py"), f"hydra.run.dir={run}", "trainer.max_steps=6", cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert res.stderr.strip() == res.stderr.strip().splitlines()[-1], res.stderr  # one line
    assert f"{saved}:{len(lines) + 1}: " in res.stderr and "is refused" in res.stderr
    assert not marker.exists()
    assert _files(run) == before  # not a byte, not an mtime


def test_a_target_on_the_command_line_is_refused_before_training(corpus: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    res = cli(str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache"), f"hydra.run.dir={tmp_path / 'run'}",
              _hostile(marker)["plugins"], cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "trainer.plugins[0]._target_='lmlab.record.rundir.atomic_write' is not something lmlab builds" in res.stderr
    assert not marker.exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_eval_refuses_a_run_whose_recorded_config_names_a_callable(finished_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    summary = json.loads((run / "summary.json").read_text())
    summary["config"]["trainer"]["strategy"] = {"_target_": "torch.save"}
    (run / "summary.json").write_text(json.dumps(summary))
    res = cli(str(ROOT / "eval.py"), f"run={run}", cwd=tmp_path)
    assert res.returncode == 2 and f"{run}/summary.json: trainer.strategy._target_='torch.save'" in res.stderr, \
        res.stderr[-3000:]


def test_a_sweep_continued_with_one_hostile_job_exits_non_zero_and_runs_nothing_hostile(
        corpus: Path, tmp_path: Path) -> None:
    sweep, marker = tmp_path / "sweep", tmp_path / "marker"
    args = [*tiny(corpus, tmp_path / "cache", "model.n_layer=1", "trainer.max_steps=4",
                  "trainer.val_check_interval=2"), "placement=pre,post", f"hydra.sweep.dir={sweep}"]
    first = cli(str(ROOT / "train.py"), "-m", *args, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    saved = jobs[0] / ".hydra/overrides.yaml"
    _write(saved, [*OmegaConf.to_container(OmegaConf.load(saved)), _hostile(marker)["nested_in_strategy"]])
    before = _files(jobs[0])
    again = cli(str(ROOT / "train.py"), "-m", *args, "trainer.max_steps=6", cwd=tmp_path)
    assert again.returncode == 1 and f"{saved}:" in again.stderr, again.stderr[-3000:]
    assert not marker.exists() and _files(jobs[0]) == before
    assert json.loads((jobs[1] / "summary.json").read_text())["steps"] == 6  # the sweep went on with the next job
    last = again.stderr.strip().splitlines()  # and says, last, which job did not run
    assert last[-2] == "train.py: 1 job(s) of the sweep did not run to an end:", last
    assert last[-1].startswith(f"  {jobs[0]}: {saved}:"), last


def test_a_sweep_with_a_refused_job_goes_on_and_exits_non_zero(corpus: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = [*tiny(corpus, tmp_path / "cache", "model.n_layer=1", "trainer.max_steps=2", "trainer.val_check_interval=2"),
            "model.n_head=2,3", f"hydra.sweep.dir={sweep}"]  # d_model=32: 3 heads do not divide it
    res = cli(str(ROOT / "train.py"), "-m", *args, cwd=tmp_path)
    assert res.returncode == 1, res.stderr[-3000:]
    done = [json.loads(p.read_text())["status"] for p in sweep.glob("*/summary.json")]
    assert done == ["completed"]
    last = res.stderr.strip().splitlines()
    assert last[-2] == "train.py: 1 job(s) of the sweep did not run to an end:" and "n_head=3" in last[-1], last
    # the sweep's own last lines (issue 65): where it is, how its jobs ended, the commands that look at it
    assert res.stdout.strip().splitlines()[-3:] == [f"sweep {sweep}: 2 job(s): 1 completed, 1 failed",
                                                    f"  lmlab sweep status {sweep}", f"  lmlab compare {sweep}"]


def test_a_secret_from_the_environment_is_in_no_file_of_the_run(corpus: Path, tmp_path: Path) -> None:
    """`${oc.env:...}` on the command line: the run uses the value, and neither the saved overrides, the summary nor
    the W&B run's files hold it (they keep the interpolation); a continued run that types it again reads it from the
    environment, one that does not is refused (a value read back from a file holds no interpolation)."""

    secret, run = tmp_path / "hunter2-cache", tmp_path / "run"
    os.environ["LMLAB_TEST_SECRET"] = str(secret)
    try:
        args = [a for a in tiny(corpus, tmp_path / "unused") if not a.startswith(("data.cache_dir", "logger"))]
        res = cli(str(ROOT / "train.py"), *args, "data.cache_dir=${oc.env:LMLAB_TEST_SECRET}", "logger=wandb",
                  "trainer.max_steps=2", f"hydra.run.dir={run}", cwd=tmp_path)
        assert res.returncode == 0, res.stderr[-3000:]
        assert (secret / "shards").is_dir()  # the value was used
        leaked = [str(p.relative_to(run)) for p in run.rglob("*") if p.is_file() and b"hunter2" in p.read_bytes()]
        assert leaked == [] and (run / "wandb").is_dir()
        assert "data.cache_dir=${oc.env:LMLAB_TEST_SECRET}" in (run / ".hydra/overrides.yaml").read_text()
        # read back from the file, the interpolation is refused (a value read from a file is a literal), naming the
        # line and what to do; typed again on the command line, it is the user's: the run continues with it
        refused = cli(str(ROOT / "train.py"), f"hydra.run.dir={run}", "trainer.max_steps=3", cwd=tmp_path)
        assert refused.returncode == 2 and "overrides.yaml:" in refused.stderr, refused.stderr[-3000:]
        assert "type the value on this command line" in refused.stderr
        again = cli(str(ROOT / "train.py"), f"hydra.run.dir={run}", "trainer.max_steps=3",
                    "data.cache_dir=${oc.env:LMLAB_TEST_SECRET}", cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads((run / "summary.json").read_text())["steps"] == 3
    finally:
        del os.environ["LMLAB_TEST_SECRET"]


def test_lmlabs_own_targets_are_of_their_kind_and_a_run_of_them_is_checked_without_importing_lightning() -> None:
    """SHIPPED (what eval.py and generate.py accept without importing Lightning) holds every `_target_` of the
    shipped trainers and loggers, each a class of the kind it is listed as."""
    import subprocess

    import yaml
    from hydra._internal.utils import _locate

    from lmlab.record.trusted import KINDS, SHIPPED

    for target, kind in SHIPPED.items():
        assert issubclass(_locate(target), _locate(KINDS[kind])), target

    def targets(node):
        if isinstance(node, dict):
            yield from ([node["_target_"]] if "_target_" in node else [])
            for v in node.values():
                yield from targets(v)
        elif isinstance(node, list):
            for v in node:
                yield from targets(v)

    shipped = {t for group in ("trainer", "logger") for path in (ROOT / "lmlab/conf" / group).glob("*.yaml")
               for t in targets(yaml.safe_load(path.read_text()))}
    assert shipped and shipped <= set(SHIPPED), shipped - set(SHIPPED)
    groups = [(t.stem, lg.stem) for t in (ROOT / "lmlab/conf/trainer").glob("*.yaml")
              for lg in (ROOT / "lmlab/conf/logger").glob("*.yaml")]
    code = ("import sys; from lmlab import compose; from lmlab.record.trusted import check_config_targets; "
            f"[check_config_targets(compose([f'trainer={{t}}', f'logger={{lg}}'])) for t, lg in {groups!r}]; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'lightning'))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout[-2000:] + res.stderr[-2000:]


# --- issue 59: the manifest never chooses where code runs ------------------------------------------------------------

def _planted(d: Path, marker: Path) -> Path:
    """A directory holding packages named like lmlab's and its tokenizer's, each creating `marker` when imported."""
    for name in ("lmlab", "tokenizers", "pip"):
        (d / name).mkdir(parents=True)
        (d / name / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write({name!r})\n")
    return d


def test_a_child_interpreter_imports_nothing_from_the_working_directory(tmp_path: Path) -> None:
    import subprocess

    from lmlab.env import child_python

    marker = tmp_path / "imported"
    planted = _planted(tmp_path / "shared", marker)
    res = subprocess.run(child_python("import lmlab, tokenizers; print(lmlab.__file__)"), cwd=planted,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(planted)})
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == str(ROOT / "lmlab" / "__init__.py") and not marker.exists(), res.stdout
    pip = subprocess.run([sys.executable, "-I", "-m", "pip", "--version"], cwd=planted, capture_output=True,
                         text=True, timeout=120)  # the corpus fetch's child
    assert pip.returncode == 0 and not marker.exists(), pip.stderr[-2000:]


def test_sweep_resume_runs_here_not_in_the_manifests_cwd(corpus: Path, tmp_path: Path) -> None:
    """A shared sweep whose manifest names a directory holding a planted `lmlab/` and `tokenizers/` as its `cwd`:
    the resumed job (a BPE tokenizer, trained in a child interpreter) completes and nothing planted is imported."""
    from lmlab.record import sweep
    from lmlab.record.rundir import dumps

    marker = tmp_path / "imported"
    planted = _planted(tmp_path / "shared", marker)
    d = tmp_path / "sweep"
    d.mkdir()
    command = ["python train.py", "-m", *tiny(corpus, tmp_path / "cache", "data.tokenizer=bpe", "data.vocab_size=300",
                                               "trainer.max_steps=2", "trainer.val_check_interval=2"), "seed=1,2"]
    jobs = [{"num": i, "dir": f"seed={i + 1}", "overrides": [f"seed={i + 1}"], "state": "pending", "scheduler_id": None}
            for i in range(2)]
    (d / sweep.MANIFEST).write_text(dumps({"format": 1, "command": command, "cwd": str(planted), "jobs": jobs,
                                           "submitter": {"pid": 0, "host": "gone"}}))
    res = cli("-m", "lmlab", "sweep", "resume", str(d), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "2 job(s) to run" in res.stdout
    assert [json.loads(p.read_text())["status"] for p in d.glob("*/summary.json")] == ["completed"] * 2
    assert not marker.exists() and not list(planted.rglob("*.json"))
