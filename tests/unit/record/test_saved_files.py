"""Every other file lmlab reads back from a run or sweep directory, hostile (issue 59): a study database that never
ends counting, a safetensors file with integer weights or a bad header, a tokenizer.json that is corrupt or larger than
the model's vocabulary, and a launcher string that would be a line of its own in an sbatch script — each refused in
one line naming the file (or key), within seconds."""

from __future__ import annotations

import json
import sqlite3
import struct
import time
from pathlib import Path

import pytest
import torch

import lmlab
from hydra_plugins.lmlab_slurm.launcher import check_lines
from lmlab.data.tokenizer import TOKENIZERS, load_tokenizer, save_tokenizer
from lmlab.interop.hf import check_safetensors


def test_a_study_database_whose_trials_never_end_is_refused_within_its_bound(tmp_path: Path, monkeypatch) -> None:
    db = tmp_path / "optuna.db"
    with sqlite3.connect(db) as con:  # `trials` a view of an endless recursive count
        con.execute("CREATE VIEW trials AS WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n) "
                    "SELECT i FROM n")
    monkeypatch.setattr(lmlab, "STUDY_READ_S", 1)
    start = time.monotonic()
    with pytest.raises(ValueError, match=f"^{db}: its `trials` is not a table"):
        lmlab._study_seed(str(db), 3)
    with sqlite3.connect(db) as con:
        con.execute("DROP VIEW trials")
        con.execute("CREATE TABLE base (i INTEGER)")
        con.execute("CREATE TABLE trials (i INTEGER)")
        con.executemany("INSERT INTO trials VALUES (?)", [(i,) for i in range(4)])
    assert lmlab._study_seed(str(db), 3) == 7  # a real study's count: the seed plus its trials
    assert time.monotonic() - start < 30


def _safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    return path


def test_integer_weights_and_a_bad_header_are_refused_naming_the_file_and_tensor(tmp_path: Path) -> None:
    good = _safetensors(tmp_path / "good.safetensors", {"w": torch.ones(2, 2),
                                                        "h": torch.ones(2, dtype=torch.bfloat16)})
    check_safetensors(good)
    bad = _safetensors(tmp_path / "model.safetensors", {"w": torch.ones(2, 2), "lm_head.weight": torch.ones(
        2, dtype=torch.int64)})
    with pytest.raises(ValueError, match=rf"^{bad}: the tensor 'lm_head.weight' is 'I64'"):
        check_safetensors(bad)
    for name, data in (("short", b"\x01\x02"), ("huge", struct.pack("<Q", 1 << 40) + b"{}"),
                       ("not_json", struct.pack("<Q", 4) + b"{{{{"), ("list", struct.pack("<Q", 2) + b"[]")):
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(data)
        with pytest.raises(ValueError, match=rf"^{path}: "):
            check_safetensors(path)


def test_a_tokenizer_past_the_models_vocabulary_or_corrupt_is_refused_naming_both(tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tok = TOKENIZERS["char"](["abcdefgh ijkl"], vocab_size=0, eod=None)
    save_tokenizer(tok, path)
    size = tok.get_vocab_size(with_added_tokens=True)
    assert load_tokenizer(path, size).get_vocab_size(with_added_tokens=True) == size
    with pytest.raises(ValueError, match=rf"^{path}: the tokenizer has {size} ids and the model's vocabulary 5"):
        load_tokenizer(path, 5)
    path.write_text(json.dumps({"model": {"type": "nope"}}))
    with pytest.raises(ValueError, match=rf"^{path}: not a tokenizer.json"):
        load_tokenizer(path)


def test_a_launcher_string_is_one_line_of_the_sbatch_script() -> None:
    check_lines({"comment": "a sweep", "additional_parameters": {"signal": "USR1@120"}, "setup": ["module load x"]})
    for params, key in (({"comment": "x\ntouch /tmp/pwned"}, "hydra.launcher.comment"),
                        ({"additional_parameters": {"mail": "a\rb"}}, "hydra.launcher.additional_parameters.mail"),
                        ({"setup": ["ok", "x\x00y"]}, r"hydra.launcher.setup\[1\]")):
        with pytest.raises(ValueError, match=rf"^{key}=.*a control character"):
            check_lines(params)


def test_a_recorded_config_calls_only_resolvers_that_compute_a_value(tmp_path: Path) -> None:
    """A run's `.hydra/config.yaml` (read back by eval.py, generate.py and export while the run is going) keeps its
    interpolations: one of lmlab's own that computes a value is read; one that makes a config or a directory, or whose
    resolver is named by an interpolation, is refused naming the key."""
    from lmlab.record.saved import SavedStateRefused, check_config

    path = tmp_path / "config.yaml"
    fine = {"data": {"cache_dir": "${oc.env:LMLAB_CACHE,${oc.env:HOME}/.cache/lmlab}", "batch_size": 8},
            "schedule": {"decay_from": "${lmlab.step_at:0.67,${trainer.max_steps}}"}, "model": {"n_layer": "${seed}"}}
    assert check_config(fine, path) is fine
    for key, value in (("data.paths", "${oc.create:'{_target_: torch.save}'}"), ("data.name", "${oc.${x}:y}"),
                       ("data.cache_dir", "${lmlab.sqlite:/tmp/elsewhere/db}"), ("model.norm", "${oc.decode:'{}'}")):
        group, _, leaf = key.partition(".")
        config = {**fine, group: {**fine.get(group, {}), leaf: value}}
        with pytest.raises(SavedStateRefused, match=rf"^{path}: {key}="):
            check_config(config, path)


@pytest.mark.parametrize("text, why", [("[" * 100_000 + "]" * 100_000, "nests too deep"), ("{", "is not valid JSON"),
                                       ("[1, 2]", "holds a list, not an object")])
def test_a_hostile_summary_is_one_refusal_naming_it(tmp_path: Path, text: str, why: str) -> None:
    from lmlab.record.rundir import RunDir

    run = RunDir(tmp_path)
    run.summary.write_text(text)
    with pytest.raises(ValueError, match=rf"^{run.summary}.*{why}"):
        run.read_summary()
