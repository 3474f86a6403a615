"""The installed command (`lmlab train|eval|generate|compare|bench`, `python -m lmlab`) and the names of sweep jobs:
a sweep command run again with more steps continues its jobs in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmlab import _job_dirname
from lmlab.cli import continue_command, dirname_exclusions, quote_paths, resumable
from lmlab.commands import COMMANDS, main


def test_the_command_lists_its_commands_and_refuses_an_unknown_one(capsys) -> None:
    main(["--help"])
    out = capsys.readouterr().out
    assert all(f"  {name} " in out for name in COMMANDS)
    with pytest.raises(SystemExit) as stop:
        main(["trian", "norm=rms"])
    assert stop.value.code == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train, eval, generate, compare, sweep, bench" in err


def test_resumable_keys_are_the_ones_a_continued_run_may_change() -> None:
    assert all(resumable(k) for k in ("trainer.max_steps", "logger", "monitor.every_n_steps", "threads"))
    assert not any(resumable(k) for k in ("norm", "model.n_layer", "trainer.devices", "optim.lr", "loggerx"))


def test_a_sweep_leaves_the_resumable_keys_it_sets_once_out_of_its_job_names() -> None:
    argv = ["-m", "placement=pre,post", "trainer.max_steps=60", "logger=csv", "model.n_layer=2"]
    assert dirname_exclusions(argv) == ["hydra.job.config.override_dirname.exclude_keys=[trainer.max_steps,logger]"]
    # swept, the steps name the jobs (two jobs, two directories); outside a sweep there are no job names
    assert dirname_exclusions(["-m", "trainer.max_steps=60,120", "logger=csv"]) == [
        "hydra.job.config.override_dirname.exclude_keys=[logger]"]
    assert dirname_exclusions(["trainer.max_steps=60"]) == []
    assert dirname_exclusions(["-m", "seed=1,2"]) == []
    # the user's own setting is Hydra's and stays theirs
    assert dirname_exclusions(["-m", "trainer.max_steps=60", "hydra.job.config.override_dirname.exclude_keys=[seed]"]
                              ) == []


def test_a_job_named_by_an_earlier_lmlab_keeps_its_directory(tmp_path: Path) -> None:
    task = ["placement=pre", "trainer.max_steps=60"]
    assert _job_dirname("placement=pre", task, str(tmp_path)) == "placement=pre"  # nothing there yet: the new name
    old = tmp_path / "placement=pre,trainer.max_steps=60"
    old.mkdir()
    (old / "summary.json").write_text("{}")
    assert _job_dirname("placement=pre", task, str(tmp_path)) == old.name  # the old run is continued in place
    (tmp_path / "placement=pre").mkdir()
    assert _job_dirname("placement=pre", task, str(tmp_path)) == "placement=pre"  # the new one once it exists
    assert _job_dirname("", [], str(tmp_path)) == "default"


def test_the_continue_command_pastes_into_a_shell() -> None:
    """The interrupt line's command, split by a shell and read by train's Hydra, names the run's directory exactly
    (sweep jobs' names hold '=' and ','; paths may hold spaces)."""
    import shlex

    from hydra.core.override_parser.overrides_parser import OverridesParser

    for path in ("multirun/x/placement=post,seed=1", "/data/my runs/a"):
        words = shlex.split(continue_command(path))
        assert words[:2] == ["python", "train.py"]
        override = OverridesParser.create().parse_override(quote_paths(words[2:], ("hydra.run.dir",))[0])
        assert (override.key_or_group, override.value()) == ("hydra.run.dir", path)


@pytest.mark.parametrize("config, args, said", [
    ("train", ["optim.lrr=1e-3"], "optim.lrr=1e-3: optim has no key 'lrr'; did you mean optim.lr?"),
    ("train", ["norm=rsm"], "norm=rsm: norm has no option 'rsm'; did you mean rms? (the options: batch, dyt, layer, "
                            "ngpt, none, rms, scale)"),
    ("train", ["-m", "norm=rms,rsm"], "norm=rms,rsm: norm has no option 'rsm'; did you mean rms? (the options: batch, "
                                      "dyt, layer, ngpt, none, rms, scale)"),
    ("train", ["nrom=rms"], "nrom=rms: there is no config group or key 'nrom'; did you mean norm or init_from?"),
    ("train", ["norm=layer", "norm.epss=1e-5"], "norm.epss=1e-5: norm has no key 'epss'; did you mean norm.eps?"),
    ("train", ["data=text_files", "data.pathz=[a]"], "data.pathz=[a]: data has no key 'pathz'; did you mean "
                                                     "data.paths?"),
    ("generate", ["run=x", "promt=hi"], "promt=hi: there is no config group or key 'promt'; did you mean prompt?"),
    ("eval", ["run=x", "lenghts=[256]"], "lenghts=[256]: there is no config group or key 'lenghts'; did you mean "
                                         "lengths or weights?"),
    ("train", ["model.n_layer=["], "model.n_layer=[: Hydra's override grammar cannot parse it (no viable alternative "
                                   "at input '['); see https://hydra.cc/docs/advanced/override_grammar/basic/"),
])
def test_an_unknown_group_option_or_key_is_named_with_the_closest(config: str, args: list[str], said: str) -> None:
    from lmlab.commands.refusals import unknown_override

    assert unknown_override(config, [a for a in args if not a.startswith("-")]) == said


def test_each_option_of_a_list_group_is_checked() -> None:
    """'residual=[x0,scaeld]': the misspelt one named with the closest (the whole list was refused as one option)."""
    from lmlab.commands.refusals import unknown_override

    said = unknown_override("train", ["residual=[x0,scaeld]"])
    assert said.startswith("residual=[x0,scaeld]: residual has no option 'scaeld'; did you mean scaled? (the options: ")
    assert unknown_override("train", ["residual=[x0,scaled]"]) is None


@pytest.mark.parametrize("args", [
    ["data=text_files", "data.paths=[/a,/b]", "norm.eps=1e-5", "model.n_layer=2", "+optim.new_key=1"],  # ??? paths
    ["experiment=postnorm_warmup", "schedule.warmup_steps=0,150", "hydra.sweep.dir=S", "hydra/launcher=slurm"],
    ["experiment=glob(*)", "~optim.lr", "trainer.max_steps=range(1,3)", "norm=null"],
    ["residual=[scaled,x0]", "residual.scaled.stream=true"],  # several options of a list group (the README's form)
])
def test_what_hydra_accepts_passes_the_check(args: list[str]) -> None:
    from lmlab.commands.refusals import unknown_override

    assert unknown_override("train", args) is None
