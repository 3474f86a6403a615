"""What lmlab reads back from a run or sweep directory is data, never code (issue 33's Critical): saved overrides with
a `_target_` (top level, nested in a valid value, in one job of a sweep) are refused naming the file and line, with
nothing built or written; every `_target_` the trainer and loggers take is a Lightning or lmlab class of the kind its
place takes, whoever wrote it (a saved file or the command line)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger
from omegaconf import OmegaConf

from lmlab import compose
from lmlab.record.saved import SavedStateRefused, check_config, read_overrides
from lmlab.record.trusted import check_targets
from tests.runs import ROOT, cli, tiny

GENUINE = ["norm=rms", "data.paths=[/data/a, /data/b]", "model.attention.pattern=[4,4,0]", "+seed_note=7",
           "~targets", "data.cache_dir=${oc.env:HOME}/cache", "optim.lr=3e-4", "hydra_note=1"]


def _hostile(marker: Path) -> dict[str, str]:
    """Each form found writing `marker` when a run was continued (or that could build a config when read)."""
    writer = f"{{_target_: lmlab.record.rundir.atomic_write, path: {marker}, data: owned}}"
    return {
        "plugins": f"+trainer.plugins=[{writer}]",
        "nested_in_strategy": "trainer.strategy={_target_: lightning.pytorch.strategies.SingleDeviceStrategy, "
                              f"device: cpu, checkpoint_io: {writer}}}",
        "top_level": f"+evil={{_target_: numpy.save, file: {marker}, arr: 1}}",
        "target_as_key": "trainer._target_=torch.save",
        "partial_as_key": "+trainer.strategy._partial_=true",
        "decode_resolver": "trainer.strategy=${oc.decode:'{_target_: torch.save}'}",
        "hydra_setting": "hydra.run.dir=/elsewhere",
        "sweep": "norm=rms,layer",
        "dict_for_a_scalar": "trainer.max_steps={steps: 5}",
        "dict_in_a_list": "data.paths=[{_target_: torch.save}]",
    }


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(lines)))
    return path


def test_genuine_saved_overrides_read_back_as_written(tmp_path: Path) -> None:
    assert read_overrides(_write(tmp_path / "overrides.yaml", GENUINE), compose([])) == GENUINE
    assert read_overrides(_write(tmp_path / "empty.yaml", [])) == []


@pytest.mark.parametrize("form", sorted(_hostile(Path("m"))))
def test_a_hostile_saved_override_is_refused_naming_the_file_and_line(tmp_path: Path, form: str) -> None:
    line = _hostile(tmp_path / "marker")[form]
    path = _write(tmp_path / "overrides.yaml", [*GENUINE[:3], line, *GENUINE[3:]])
    with pytest.raises(SavedStateRefused) as err:
        read_overrides(path, compose([]))
    message = str(err.value)
    assert message.startswith(f"{path}:4: ") and "\n" not in message, message
    assert not (tmp_path / "marker").exists()


@pytest.mark.parametrize("text, why", [("trainer: {max_steps: 5}\n", "a list of key=value overrides is expected"),
                                       ("- norm=rms\n- {_target_: torch.save}\n", ":2: each saved override is one"),
                                       ("- norm=rms\n- [a, b]\n", ":2: each saved override is one"),
                                       ("- norm=rms\n- 5\n", ":2: each saved override is one"),
                                       ("- norm: [\n", "not valid YAML")])
def test_a_saved_overrides_file_that_is_not_a_list_of_strings_is_refused(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "overrides.yaml"
    path.write_text(text)
    with pytest.raises(SavedStateRefused, match=why):
        read_overrides(path)


@pytest.mark.parametrize("target", ["lmlab.record.rundir.atomic_write", "torch.save", "numpy.save", "builtins.exec",
                                    "os.system", "lightning.pytorch.utilities.rank_zero.rank_zero_only",
                                    "lightning.pytorch.Trainer", "lmlab.model.gpt.GPT", "lmlab.nope.Missing"])
def test_the_trainer_builds_only_lightning_and_lmlab_classes_of_their_kind(target: str) -> None:
    """A function (lmlab's own writer, torch.save), a class outside Lightning and lmlab, a class of the wrong kind (a
    Trainer as a strategy, lmlab's GPT): refused naming the key."""
    cfg = {"_target_": "lightning.pytorch.Trainer", "strategy": {"_target_": target}}
    with pytest.raises(ValueError, match=r"^trainer\.strategy\._target_=.* is not something lmlab builds"):
        check_targets(cfg, "trainer", Trainer)
    with pytest.raises(ValueError, match=r"^trainer\.plugins\[1\]\._target_="):
        check_targets({"_target_": "lightning.pytorch.Trainer", "plugins": [{"_target_": (
            "lightning.pytorch.plugins.TorchCheckpointIO")}, {"_target_": target}]}, "trainer", Trainer)


def test_a_module_outside_lightning_and_lmlab_is_not_even_imported() -> None:
    assert "antigravity" not in sys.modules
    with pytest.raises(ValueError, match="antigravity.fly"):
        check_targets({"_target_": "antigravity.fly"}, "logger.x", Logger)
    assert "antigravity" not in sys.modules
    with pytest.raises(ValueError, match=r"trainer\.strategy\._partial_"):
        check_targets({"_target_": "lightning.pytorch.Trainer", "strategy": {
            "_target_": "lightning.pytorch.strategies.DDPStrategy", "_partial_": True}}, "trainer", Trainer)


@pytest.mark.parametrize("trainer", sorted(p.stem for p in (ROOT / "lmlab/conf/trainer").glob("*.yaml")))
@pytest.mark.parametrize("logger", sorted(p.stem for p in (ROOT / "lmlab/conf/logger").glob("*.yaml")))
def test_every_shipped_trainer_and_logger_is_buildable(trainer: str, logger: str) -> None:
    cfg = compose([f"trainer={trainer}", f"logger={logger}"])
    check_targets(cfg.trainer, "trainer", Trainer)
    for name, spec in (cfg.logger or {}).items():
        check_targets(spec, f"logger.{name}", Logger)
    check_config(OmegaConf.to_container(cfg), Path("config.yaml"))


def test_a_recorded_config_is_checked_like_the_trainer(tmp_path: Path) -> None:
    golden = OmegaConf.to_container(OmegaConf.load(ROOT / "tests/golden/run_0db55d9/.hydra/config.yaml"))
    check_config(golden, tmp_path / "config.yaml")
    for where, bad in (("trainer", {**golden["trainer"], "strategy": {"_target_": "torch.save"}}),
                       ("model", {**golden["model"], "norm": {"_target_": "lmlab.record.rundir.atomic_write"}})):
        with pytest.raises(SavedStateRefused, match=rf"^{tmp_path}/config.yaml: {where}\."):
            check_config({**golden, where: bad}, tmp_path / "config.yaml")


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


@pytest.mark.e2e
@pytest.mark.parametrize("form", ["plugins", "nested_in_strategy", "top_level"])
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


@pytest.mark.e2e
def test_a_target_on_the_command_line_is_refused_before_training(corpus: Path, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    res = cli(str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache"), f"hydra.run.dir={tmp_path / 'run'}",
              _hostile(marker)["plugins"], cwd=tmp_path)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "trainer.plugins[0]._target_='lmlab.record.rundir.atomic_write' is not something lmlab builds" in res.stderr
    assert not marker.exists() and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.e2e
def test_eval_refuses_a_run_whose_recorded_config_names_a_callable(finished_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    summary = json.loads((run / "summary.json").read_text())
    summary["config"]["trainer"]["strategy"] = {"_target_": "torch.save"}
    (run / "summary.json").write_text(json.dumps(summary))
    res = cli(str(ROOT / "eval.py"), f"run={run}", cwd=tmp_path)
    assert res.returncode == 2 and f"{run}/summary.json: trainer.strategy._target_='torch.save'" in res.stderr, \
        res.stderr[-3000:]


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
def test_a_secret_from_the_environment_is_in_no_file_of_the_run(corpus: Path, tmp_path: Path) -> None:
    """`${oc.env:...}` on the command line: the run uses the value, and neither the saved overrides, the summary nor
    the W&B run's files hold it (they keep the interpolation); the continued run reads it from the environment."""
    import os

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
        again = cli(str(ROOT / "train.py"), f"hydra.run.dir={run}", "trainer.max_steps=3", cwd=tmp_path)
        assert again.returncode == 0, again.stderr[-3000:]
        assert json.loads((run / "summary.json").read_text())["steps"] == 3
    finally:
        del os.environ["LMLAB_TEST_SECRET"]
