"""Zero-shot length extension through eval, and fine-tuning at a longer length from a run (init_from)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmlab import compose
from lmlab.analysis.evaluate import RunRefused, evaluate
from lmlab.model.rope_scaling import ROPE_SCALINGS
from lmlab.run.training import train
from tests.runs import ROOT, tiny

L = 32


@pytest.fixture(scope="module")
def rope_run(corpus: Path, tmp_path_factory) -> Path:  # noqa: F811
    d = tmp_path_factory.mktemp("rope")
    run = d / "run"
    train(compose(tiny(corpus, d / "cache", "position=rope", "trainer.max_steps=20")), run)
    return run


def test_length_sweep_is_paired_and_dynamic_methods_leave_the_trained_length_untouched(rope_run: Path) -> None:
    result = evaluate(rope_run, lengths=[L, 4 * L], allow_extrapolation=True, out_dir=rope_run / "eval",
                      max_windows=6)
    rows = {(r["length"], r["rope_scaling"]): r for r in result["rows"]}
    ramped = {f"{n}:ramp=ratio" for n in ("dynamic_yarn", "ntk_by_parts", "yarn")}  # the paper's ramp next to HF's
    assert {s for _, s in rows} == set(ROPE_SCALINGS) | ramped  # the default sweeps every method
    for name in ramped:  # the same model at the trained length; another one past it
        base = name.split(":")[0]
        assert rows[(L, name)]["loss"] == pytest.approx(rows[(L, "none")]["loss"], abs=1e-6), name
        assert rows[(4 * L, name)]["loss_beyond"] != rows[(4 * L, base)]["loss_beyond"], name  # 20 steps: close
    assert len({r["windows"] for r in result["rows"] if r["length"] == 4 * L}) == 1  # same windows for all
    plain = rows[(4 * L, "none")]
    for name in ("dynamic_linear", "dynamic_ntk", "dynamic_yarn"):  # s = max(1, n/L): positions < L are the plain model
        assert rows[(4 * L, name)]["loss_inside"] == pytest.approx(plain["loss_inside"], abs=1e-9), name
        assert rows[(4 * L, name)]["loss_beyond"] != pytest.approx(plain["loss_beyond"], abs=1e-6), name
    # PI squeezes every position, the trained ones included; at the trained length every method is the plain model
    assert abs(rows[(4 * L, "linear")]["loss_inside"] - plain["loss_inside"]) > 1e-6
    for name in ROPE_SCALINGS:
        assert rows[(L, name)]["loss"] == pytest.approx(rows[(L, "none")]["loss"], abs=1e-6), name
    # attention entropy (the note's reason for YaRN's temperature): more keys spread it; YaRN is ntk_by_parts with
    # the temperature √(1/t) = 0.1·ln(s) + 1 on top, which scales the logits up and pulls the entropy back
    assert rows[(4 * L, "none")]["attn_entropy"] > rows[(L, "none")]["attn_entropy"]
    assert rows[(4 * L, "yarn")]["attn_entropy"] < rows[(4 * L, "ntk_by_parts")]["attn_entropy"]
    assert rows[(L, "yarn")]["attn_entropy"] == pytest.approx(rows[(L, "none")]["attn_entropy"], abs=1e-6)
    for f in ("eval.md", "eval.csv", "eval.json", "plots/length_extension.png"):
        assert (rope_run / "eval" / f).exists(), f
    per_position = json.loads((rope_run / "eval" / "eval.json").read_text())["per_position"]
    assert len(per_position["yarn"][str(4 * L)]) == 4 * L


def test_a_method_with_a_setting(rope_run: Path) -> None:
    from lmlab.analysis.evaluate import scaling_spec

    assert scaling_spec("yarn:ramp=ratio") == {"name": "yarn", "ramp": "ratio"}
    assert scaling_spec("ntk:factor=2") == {"name": "ntk", "factor": 2}
    with pytest.raises(ValueError, match=r"rope_scaling='llama3' does not take \['ramp'\]"):
        evaluate(rope_run, lengths=[2 * L], scalings=["llama3:ramp=ratio"])
    with pytest.raises(ValueError, match=r"rope_scaling.ramp='pair' must be one of"):
        scaling_spec("yarn:ramp=pair")
    with pytest.raises(ValueError, match="name:key=value"):
        scaling_spec("yarn:ramp")


def test_refuses_past_the_trained_length_without_a_method(rope_run: Path) -> None:
    with pytest.raises(RunRefused, match="allow_extrapolation"):
        evaluate(rope_run, lengths=[2 * L], scalings=["none"])
    evaluate(rope_run, lengths=[2 * L], scalings=["yarn"], max_windows=2)  # a method: fine


def test_finetune_at_a_longer_length_from_a_run(rope_run: Path, corpus: Path, tmp_path: Path) -> None:  # noqa: F811
    run = tmp_path / "long"
    summary = train(compose(tiny(corpus, tmp_path / "cache", "position=rope", f"init_from={rope_run}",
                                 f"model.max_seq_len={2 * L}", "rope_scaling=yarn", "trainer.max_steps=3")), run)
    assert summary["status"] == "completed"
    assert summary["model"]["rope_scaling"]["original_max_len"] == L  # scaled relative to the source's length
    assert (run / "tokenizer.json").read_text() == (rope_run / "tokenizer.json").read_text()
    first = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]["model.wte.weight"]
    source = torch.load(rope_run / "checkpoints" / "last.ckpt", weights_only=False)["state_dict"]["model.wte.weight"]
    assert (first - source).abs().max() < 0.05  # 3 small steps from the source weights, not a fresh init
    result = evaluate(run, lengths=[2 * L], scalings=["yarn"], max_windows=2)
    assert result["trained_len"] == 2 * L


def test_init_from_refuses_another_architecture(rope_run: Path, corpus: Path, tmp_path: Path) -> None:  # noqa: F811
    with pytest.raises(ValueError, match=r"init_from=.*model/norm"):
        train(compose(tiny(corpus, tmp_path / "cache", "position=rope", "norm=rms", f"init_from={rope_run}")),
              tmp_path / "x")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_an_interrupted_length_sweep_keeps_its_finished_cells_and_a_rerun_does_the_rest(
        rope_run: Path, tmp_path: Path, signum: int) -> None:
    """eval.py prints a line per finished cell; a signal after the first keeps it (one line, exit 128 + signal), and
    the same command computes only the cells left, to the same table as an uninterrupted sweep."""
    out = tmp_path / "eval"
    args = [sys.executable, str(ROOT / "eval.py"), f"run={rope_run}", f"out={out}", "lengths=[32,64,128,256]",
            "methods=[none,linear,dynamic_ntk,yarn]", "allow_extrapolation=true", "max_windows=16", "batch_size=2"]
    proc = subprocess.Popen(args, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stderr:  # progress lines: `eval run: 3%, about 41s left: length 32 rope_scaling=none loss ...`
        lines.append(line)
        if "rope_scaling=" in line:
            proc.send_signal(signum)
            break
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signum, err[-2000:]
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err[-2000:]
    kept = [json.loads(line) for line in (out / "cells.jsonl").read_text().splitlines()]
    assert 1 <= len(kept) < 16 and f"{len(kept)} of 16 cells kept" in err
    assert not (out / "eval.json").exists()

    res = subprocess.run(args, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"{len(kept)} of 16 cells from the interrupted evaluation" in res.stderr
    assert sum("rope_scaling=" in line for line in res.stderr.splitlines()) == 16 - len(kept)  # only the rest
    assert not (out / "cells.jsonl").exists()
    rows = {(r["length"], r["rope_scaling"]): r for r in json.loads((out / "eval.json").read_text())["rows"]}
    assert len(rows) == 16
    first = json.loads(kept[0]["key"])
    assert rows[tuple(first)] == kept[0]["row"]  # the kept cell, as it was
    whole = evaluate(rope_run, lengths=[32, 64, 128, 256], scalings=["none", "linear", "dynamic_ntk", "yarn"],
                     allow_extrapolation=True, max_windows=16, batch_size=2)
    for r in whole["rows"]:
        assert rows[(r["length"], r["rope_scaling"])]["loss"] == pytest.approx(r["loss"], abs=1e-6)
