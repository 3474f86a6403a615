"""Values are checked by type and range before any data is read, by one mechanism: each option's signature
(`lr: Annotated[float, Range(gt=0)]`), the GPTConfig fields and the eval arguments are annotated, and a bad value
fails with a ValueError naming the key as the user types it and what it must be."""

from __future__ import annotations

import inspect
import os
import warnings
from pathlib import Path

import pytest
import torch

from lmlab import compose
from lmlab.config import GPTConfig
from lmlab.model.activation import ACTIVATIONS
from lmlab.model.attention import ATTENTIONS
from lmlab.model.ffn import FFNS
from lmlab.model.init import INITS
from lmlab.model.norm import NORMS
from lmlab.model.placement import PLACEMENTS
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.model.rope_scaling import ROPE_SCALINGS
from lmlab.optim import OPTIMIZERS, SCHEDULES
from lmlab.run.training import check_config

REGISTRIES = {"norm": NORMS, "placement": PLACEMENTS, "activation": ACTIVATIONS, "ffn": FFNS,
              "position": POSITIONS, "rope_scaling": ROPE_SCALINGS, "attention": ATTENTIONS, "init": INITS,
              "optim": OPTIMIZERS, "schedule": SCHEDULES}
OPTIONS = [(g, n) for g in sorted(REGISTRIES) for n in sorted(REGISTRIES[g])]


def _refused(overrides: list[str]) -> str:
    with pytest.raises(ValueError) as err:
        check_config(compose(overrides))
    return str(err.value)


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.lr=abc"], "optim.lr='abc' must be a float"),
    (["schedule.warmup_steps=ten"], "schedule.warmup_steps='ten' must be an integer"),
    (["schedule.warmup_steps=1.5"], "schedule.warmup_steps=1.5 must be an integer"),
    (["schedule.warmup_steps=true"], "schedule.warmup_steps=True must be an integer"),  # a bool is not an int
    (["norm.affine=maybe"], "norm.affine='maybe' must be true or false"),
    (["optim.betas=[0.9]"], "optim.betas=[0.9] must be a list of 2 floats"),
    (["optim=sgd", "optim.nesterov=1"], "optim.nesterov=1 must be true or false"),
    (["position=rope", "rope_scaling=yarn", "rope_scaling.factor=big"], "rope_scaling.factor='big' must be a float"),
    (["model.n_layer=true"], "model.n_layer=True must be an integer"),
    (["model.dropout=lots"], "model.dropout='lots' must be a float"),
    (["trainer.max_steps=abc"], "trainer.max_steps='abc' must be an integer"),
    (["seed=abc"], "seed='abc' must be an integer"),
    (["optim.weight_decay=abc"], "optim.weight_decay='abc' must be a float"),
])
def test_a_value_of_the_wrong_type_names_the_key(overrides: list[str], message: str) -> None:
    assert message in _refused(overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.lr=nan"], "optim.lr=nan is not a finite number"),
    (["optim.lr=inf"], "optim.lr=inf is not a finite number"),
    (["norm.eps=-inf"], "norm.eps=-inf is not a finite number"),
    (["optim.betas=[0.9,nan]"], "optim.betas=[0.9, nan] must be a list of 2 floats"),
])
def test_non_finite_floats_are_refused(overrides: list[str], message: str) -> None:
    assert message in _refused(overrides)


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim.lr=0"], "optim.lr=0 must be a float > 0"),
    (["optim.lr=-1e-3"], "optim.lr=-0.001 must be a float > 0"),
    (["optim.eps=0"], "optim.eps=0 must be a float > 0"),
    (["optim.betas=[0.9,1.0]"], "optim.betas=[0.9, 1.0] must be a list of 2 floats in [0, 1)"),
    (["optim=lion", "optim.betas=[-0.1,0.99]"], "optim.betas=[-0.1, 0.99] must be a list of 2 floats in [0, 1)"),
    (["schedule.warmup_steps=-1"], "schedule.warmup_steps=-1 must be an integer >= 0"),
    (["schedule.min_lr_ratio=2"], "schedule.min_lr_ratio=2 must be a float in [0, 1]"),
    (["norm.eps=-1e-5"], "norm.eps=-1e-05 must be a float >= 0"),
    (["attention.temperature=0"], "attention.temperature=0 must be a float > 0"),
    (["model.dropout=1.0"], "model.dropout=1.0 must be a float in [0, 1)"),
    (["model.n_head=0"], "model.n_head=0 must be an integer >= 1"),
    (["trainer.max_steps=0"], "trainer.max_steps=0 must be an integer >= 1"),
    (["optim.grad_clip=-1"], "optim.grad_clip=-1 must be a float >= 0"),
    (["threads=0"], "threads=0 must be an integer >= 1 or null"),
    (["malloc=jemalloc"], "malloc='jemalloc' must be one of ['system', 'keep']"),
    (["trainer.val_check_interval=0"], "trainer.val_check_interval=0 must be an integer >= 1"),  # was a
    (["trainer.val_check_interval=0.5"], "trainer.val_check_interval=0.5 must be an integer >= 1"),  # traceback
    (["head=mtp", "head.depth=128"], "head.depth=128 must be less than model.max_seq_len=128 (the context)"),
    (["head=mtp", "head.depth=500"], "head.depth=500 must be less than model.max_seq_len=128 (the context)"),
])
def test_a_value_out_of_range_names_the_key_and_the_range(overrides: list[str], message: str) -> None:
    assert message in _refused(overrides)


@pytest.mark.parametrize("overrides", [
    ["optim.lr=1"],  # YAML `lr: 1` is an int: fine where a float is asked for
    ["optim.betas=[0,0.5]"],  # a ListConfig of ints for tuple[float, float]
    ["norm.affine=false", "norm.eps=1"],
    ["position=rope", "rope_scaling=yarn", "rope_scaling.factor=null", "rope_scaling.original_max_len=64"],
    ["position=rope", "rope_scaling=yarn", "rope_scaling.factor=4"],
    ["schedule.warmup_steps=0", "optim.grad_clip=0", "threads=null", "optim.fused=null"],
])
def test_values_of_the_right_type_pass(overrides: list[str]) -> None:
    check_config(compose(overrides))


@pytest.mark.parametrize(("group", "name"), OPTIONS, ids=[f"{g}={n}" for g, n in OPTIONS])
def test_every_option_keyword_has_a_checkable_type(group: str, name: str) -> None:
    """Every keyword-only parameter of every option is annotated with a type the checker understands."""
    from lmlab.registry import check_value, option_defaults, option_types

    fn = REGISTRIES[group][name]
    defaults = option_defaults(fn)  # a variant's `**shared` keys: its base's defaults
    for key, annotation in option_types(fn).items():
        assert annotation is not inspect.Parameter.empty and not isinstance(annotation, str), (group, name, key)
        if key in defaults:
            check_value(f"{group}.{key}", defaults[key], annotation)  # the default fits its own annotation


def test_registry_check_value_handles_omegaconf_lists_and_unions() -> None:
    from typing import Annotated

    from omegaconf import OmegaConf

    from lmlab.registry import Range, check_value

    pair = Annotated[tuple[float, float], Range(ge=0, lt=1)]
    check_value("optim.betas", OmegaConf.create({"b": [0.9, 0]}).b, pair)
    check_value("x", None, Annotated[int, Range(ge=1)] | None)
    with pytest.raises(ValueError, match=r"^x=0 must be an integer >= 1 or null$"):
        check_value("x", 0, Annotated[int, Range(ge=1)] | None)
    with pytest.raises(ValueError, match=r"x=\{'a': 1\} must be a float"):
        check_value("x", {"a": 1}, float)


def test_ffn_sizes_are_checked_before_the_hidden_size_is_derived() -> None:
    with pytest.raises(ValueError, match=r"ffn\.hidden_mult=0 must be a float > 0"):
        resolve(GPTConfig(vocab_size=50, ffn={"name": "mlp", "hidden_mult": 0, "multiple_of": 64}))
    with pytest.raises(ValueError, match=r"ffn\.hidden_mult=-2 must be a float > 0"):
        resolve(GPTConfig(vocab_size=50, ffn={"name": "mlp", "hidden_mult": -2, "multiple_of": 64}))
    with pytest.raises(ValueError, match=r"ffn\.multiple_of=0 must be an integer >= 1"):
        resolve(GPTConfig(vocab_size=50, ffn={"name": "swiglu", "hidden_mult": 4, "multiple_of": 0}))
    assert "ffn.hidden_mult=0 must be" in _refused(["ffn.hidden_mult=0"])


def test_warmup_longer_than_the_run_warns_naming_both_keys() -> None:
    with pytest.warns(UserWarning, match=r"schedule\.warmup_steps=100.*trainer\.max_steps=50"):
        check_config(compose(["schedule.warmup_steps=100", "trainer.max_steps=50"]))
    with warnings.catch_warnings():
        # a warmup inside the run: no warning of lmlab's (others, e.g. Lightning's about an srun on PATH on a SLURM
        # login node, are not this test's: turning every warning into an error failed there)
        warnings.filterwarnings("error", message=".*warmup_steps.*")
        check_config(compose(["schedule.warmup_steps=10", "trainer.max_steps=50"]))


def test_evaluate_checks_arguments_before_loading_the_run(tmp_path: Path) -> None:
    from lmlab.analysis.evaluate import evaluate

    with pytest.raises(ValueError, match=r"lengths=\[0\] must be a list of integers >= 1"):
        evaluate(tmp_path / "no_such_run", lengths=[0])
    with pytest.raises(ValueError, match=r"rope_scaling='bogus' is not an option"):
        evaluate(tmp_path / "no_such_run", scalings=["bogus"])


# --- memory: a length whose attention bias cannot fit is refused before anything is computed ---

def test_alibi_states_the_memory_of_its_attention() -> None:
    n_head, T, batch = 4, 64, 2
    bias = POSITIONS["alibi"](32, 8, n_head, T, T, {"name": "none"}).attn_bias(T, torch.device("cpu"), torch.float32)
    scores = batch * n_head * T * T * 4  # what SDPA materialises with an explicit mask
    assert POSITIONS["alibi"].attention_bytes(n_head, T, batch) >= 2 * bias.numel() * bias.element_size() + scores
    for name in ("none", "sinusoidal", "learned", "rope"):  # no bias: nothing quadratic in the length
        assert POSITIONS[name].attention_bytes(n_head, 100_000, batch) == 0
    assert POSITIONS["alibi"].attention_bytes(n_head, 100_000, 1) / 2**30 > 100


def test_training_refuses_an_alibi_length_that_cannot_fit(monkeypatch) -> None:
    import lmlab.model.memory

    monkeypatch.setattr(lmlab.model.memory, "available_bytes", lambda device="cpu": 8 * 2**30)
    msg = _refused(["position=alibi", "model.max_seq_len=100000"])
    assert "model.max_seq_len=100000" in msg and "position=alibi" in msg and "GiB" in msg, msg
    assert "~8.0 GiB" in msg, msg
    check_config(compose(["position=alibi", "model.max_seq_len=1024"]))  # 4 x 1024² floats: fits


def test_available_memory_is_read() -> None:
    from lmlab.model.memory import available_bytes

    assert available_bytes() > 2**20


def test_evaluate_refuses_an_alibi_length_that_cannot_fit(monkeypatch, tmp_path: Path) -> None:
    """Through evaluate(): the refusal comes from the run's own position scheme, before any data is read."""
    import lmlab.analysis.evaluate
    import lmlab.model.memory

    cfg = resolve(GPTConfig(vocab_size=50, n_layer=1, d_model=32, n_head=4, max_seq_len=16, position={"name": "alibi"}))
    from lmlab.record.rundir import SavedRun

    saved = SavedRun(path=tmp_path, model=cfg.to_dict(), weights={}, step=0, config={"data": {}}, tokenizer=tmp_path)
    monkeypatch.setattr(lmlab.analysis.evaluate, "load_run", lambda run_dir, *a, **k: saved)
    monkeypatch.setattr(lmlab.analysis.evaluate, "run_data", lambda *a, **k: pytest.fail("data was read"))
    monkeypatch.setattr(lmlab.model.memory, "available_bytes", lambda device="cpu": 8 * 2**30)
    with pytest.raises(ValueError, match=r"length 100000 with position=alibi needs .*GiB.*~8\.0 GiB"):
        lmlab.analysis.evaluate.evaluate(tmp_path, lengths=[16, 100_000])


# --- devices ---

@pytest.mark.parametrize(("trainer", "named"), [
    ("fsdp", "trainer.strategy=fsdp"),
    ("gpu", "trainer.accelerator=gpu"),
    ("ddp", "trainer.accelerator=gpu"),
])
def test_gpu_trainers_without_a_gpu_name_the_fix(monkeypatch, trainer: str, named: str) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    msg = _refused([f"trainer={trainer}"])
    assert named in msg and "needs a CUDA GPU" in msg, msg
    assert "trainer.accelerator=cpu" in msg, msg


# --- data ---

def test_a_file_that_is_not_utf8_is_named(tmp_path: Path) -> None:
    from lmlab.data.corpus import load_text_files

    (tmp_path / "good.txt").write_text("some text\n")
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ValueError) as err:
        load_text_files(paths=[str(tmp_path)], cache_dir=tmp_path / "cache")
    msg = str(err.value)
    assert str(bad.resolve()) in msg and "not UTF-8 text" in msg and "good.txt" not in msg, msg


def test_non_ascii_paths_are_quoted_for_hydras_parser() -> None:
    """Hydra's grammar rejects `data.paths=[/d/é.txt]` unquoted (LexerNoViableAltException): train.py and eval.py
    quote non-ASCII path values and list items; ASCII ones are passed as typed."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from lmlab.cli import quote_paths

    parser = OverridesParser.create()
    typed = ["data.paths=[/d/é.txt,/d/b.txt]", "hydra.run.dir=/runs/ü", "model.n_layer=2", "data.paths=[/a,/b]"]
    with pytest.raises(OverrideParseException):
        parser.parse_overrides(typed[:1])
    quoted = quote_paths(typed, ())
    assert quoted == ["data.paths=['/d/é.txt',/d/b.txt]", "hydra.run.dir='/runs/ü'", *typed[2:]]
    parsed = parser.parse_overrides(quoted)
    assert parsed[0].value() == ["/d/é.txt", "/d/b.txt"] and parsed[1].value() == "/runs/ü"


def test_merging_a_runs_overrides_with_a_new_commands() -> None:
    from lmlab.cli import merge_overrides

    saved = ["norm=rms", "ffn=swiglu", "trainer.max_steps=30", "+ffn.hidden=100", "data.paths=[/a]"]
    assert merge_overrides(saved, ["trainer.max_steps=60", "logger=csv"]) == [
        "norm=rms", "ffn=swiglu", "+ffn.hidden=100", "data.paths=[/a]", "trainer.max_steps=60", "logger=csv"]
    assert merge_overrides(saved, ["ffn.hidden=120"]) == [*saved[:3], "data.paths=[/a]", "ffn.hidden=120"]
    assert merge_overrides(saved, []) == saved


def test_lightnings_srun_hint_is_not_printed_for_a_run_that_is_not_a_slurm_job(tmp_path: Path, monkeypatch) -> None:
    """With srun on PATH (every SLURM login node) Lightning warns on each run that is not an srun job; lmlab's launch
    check says what applies, so the hint is filtered before the checks that trigger it."""
    import stat

    from lightning.fabric.plugins.environments import SLURMEnvironment

    from lmlab import env

    srun = tmp_path / "bin" / "srun"
    srun.parent.mkdir()
    srun.write_text("#!/bin/sh\nexit 0\n")
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{srun.parent}:{os.environ['PATH']}")
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        SLURMEnvironment.detect()
    assert any("`srun` command is available" in str(w.message) for w in seen)  # the premise: Lightning warns
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        env.filter_warnings()
        check_config(compose(["trainer.max_steps=50", "schedule.warmup_steps=10"]))
    assert not [w for w in seen if "srun" in str(w.message)]


@pytest.mark.parametrize("key, hint", [("lr", None), ("sed", "did you mean seed or seeds?"), ("evil", None)])
def test_a_top_level_key_nothing_reads_is_refused_naming_it(key: str, hint: str | None) -> None:
    """`+lr=1e-3` added a key beside optim.lr that no part of lmlab reads (issue 33, Low): the run trained at the
    default lr and said nothing. A saved overrides file's `+key` meets the same check."""
    with pytest.raises(ValueError) as err:
        check_config(compose([f"+{key}=1"]))
    message = str(err.value)
    assert message.startswith(f"{key}: lmlab's config has no top-level key '{key}'") and "optim" in message, message
    assert hint is None or hint in message, message


def test_the_known_top_level_keys_are_train_yamls_own_and_its_groups() -> None:
    """Every shipped experiment and recipe passes check_config (tests/unit/commands/test_configs.py), which checks its
    top-level keys against these."""
    from lmlab.run.checks import top_level_keys

    assert {"seed", "optim", "trainer", "experiment", "monitor", "hydra", "targets"} <= top_level_keys()
    assert not {"defaults", "lr", "_self_"} & top_level_keys()


def test_a_read_only_file_is_one_line_naming_it(capsys) -> None:
    """A run or cache directory this user cannot write (issue 59: a traceback): one line naming the file, exit 2."""
    from lmlab.commands.refusals import usage_errors

    @usage_errors("train")
    def main() -> None:
        raise PermissionError(13, "Permission denied", "/runs/shared/.lock")

    with pytest.raises(SystemExit) as stop:
        main()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith("train.py: /runs/shared/.lock: Permission denied (a run or cache directory"), err
