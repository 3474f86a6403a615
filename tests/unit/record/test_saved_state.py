"""What lmlab reads back from a run or sweep directory is data, never code (issue 33's Critical): saved overrides with
a `_target_` (top level, nested in a valid value, in one job of a sweep) are refused naming the file and line, with
nothing built or written; every `_target_` the trainer and loggers take is a Lightning or lmlab class of the kind its
place takes, whoever wrote it (a saved file or the command line)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import Logger
from omegaconf import OmegaConf

from lmlab import compose
from lmlab.record.saved import SavedStateRefused, check_config, read_overrides
from lmlab.record.trusted import check_targets
from tests.runs import ROOT

GENUINE = ["norm=rms", "data=text_files", "data.paths=[/data/a, /data/b]", "model.n_layer=2", "+ffn.hidden=64",
           "~targets", "data.cache_dir=/scratch/cache", "optim.lr=3e-4", "residual=[value_embed,smear]",
           "downstream.tasks=[shakespeare_mc]", "norm.eps=1e-5", "schedule.warmup_steps=null"]


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
        "resolver_name_interpolated": "trainer.strategy='${oc.${perf.tag}:\"{_target_: torch.save}\"}'",
        "escaped_interpolation": "trainer.strategy='\\${oc.create:x}'",
        "env_interpolation": "data.cache_dir=${oc.env:HOME}/cache",
        "newline": "seed=5\ntouch pwned",
        "escape_character": "+optim.note='\x1b[2J'",
        "too_long": "data.paths=[" + ",".join(["/d/a"] * 2000) + "]",
        "unknown_plus_key": "+perf.tag=create",
        "plus_trainer_key": f"+trainer.default_root_dir={marker}",
        "unknown_key": "hydra_note=1",
        "mapping_in_a_list_for_a_scalar": "trainer.devices=[{a: 1}]",
        "task_file": f"downstream.tasks=[{marker}.yaml]",
        "package": "norm@model.norm=rms",
        "group_option_path": "norm=../../tmp/evil",
        "hydra_setting": "hydra.run.dir=/elsewhere",
        "sweep": "norm=rms,layer",
        "dict_for_a_scalar": "trainer.max_steps={steps: 5}",
        "dict_in_a_list": "data.paths=[{_target_: torch.save}]",
    }


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(lines)))
    return path


def test_genuine_saved_overrides_read_back_as_written(tmp_path: Path) -> None:
    assert read_overrides(_write(tmp_path / "overrides.yaml", GENUINE)) == GENUINE
    assert read_overrides(_write(tmp_path / "empty.yaml", [])) == []


@pytest.mark.parametrize("form", sorted(_hostile(Path("m"))))
def test_a_hostile_saved_override_is_refused_naming_the_file_and_line(tmp_path: Path, form: str) -> None:
    line = _hostile(tmp_path / "marker")[form]
    path = _write(tmp_path / "overrides.yaml", [*GENUINE[:3], line, *GENUINE[3:]])
    with pytest.raises(SavedStateRefused) as err:
        read_overrides(path)
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
