"""trainer=fsdp2 on CPU (gloo, 2 ranks): the figures of one process on the same global batch, sharded checkpoints
that resume exactly and are read without unpickling code, consolidation to the one-process checkpoint; per-block
sharding with bf16 parameters / fp32 reduction, checkpointing and compile; trainer=fsdp on CPU names fsdp2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lmlab import compose
from lmlab.analysis.evaluate import evaluate
from lmlab.record.consolidate import consolidate
from lmlab.record.rundir import load_checkpoint
from lmlab.run.training import train
from tests.hostile import hostile
from tests.runs import ROOT, cli, figures, metric, tiny
from tests.unit.run.test_fsdp2 import FSDP2

FIGURES = ("train/loss", "grad/norm", "grad/norm/layer_00/attn", "grad/norm/layer_01/ffn", "grad/norm/embed",
           "grad/norm/head", "param/norm/layer_01", "update/ratio/layer_00", "act/rms/layer_01",
           "attn/entropy/layer_00", "attn/max_logit/layer_01", "val/loss", "update/output_change",
           "act/ratio/layer_00/attn", "act/ratio/layer_01/ffn")

# Trains through lmlab.run.training.train, sending SIGTERM to rank 0 when step AT starts (AT < 0: never). Lightning's
# launcher starts rank 1 by running this same file again.
DRIVER = """
import os, signal, sys
from lightning.pytorch.callbacks import Callback
from lmlab import compose
from lmlab.record.consolidate import consolidate
from lmlab.analysis.evaluate import evaluate
from lmlab.run.training import train

ARGS, RUN, AT = {args!r}, {run!r}, {at!r}

class Term(Callback):
    def on_train_batch_start(self, trainer, *args):
        if trainer.global_step == AT and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)

summary = train(compose(ARGS), RUN, callbacks=[Term()])
sys.exit({{"completed": 0, "interrupted": 3}}.get(summary["status"], 1))
"""


def common(corpus: Path, cache: Path) -> list[str]:
    args = [a for a in tiny(corpus, cache) if not a.startswith(("trainer.max_steps", "data.batch",
                                                                "trainer.val_check"))]
    return [*args, "trainer.max_steps=6", "trainer.val_check_interval=3", "monitor.every_n_steps=1",
            "monitor.attn_every_n_steps=2", "optim.grad_clip=0.05"]  # clipped at every step: the sharded path too


def drive(args: list[str], run: Path, cwd: Path, at: int = -1) -> subprocess.CompletedProcess:
    script = cwd / f"drive_{run.name}.py"
    script.write_text(DRIVER.format(args=args, run=str(run), at=at))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


@pytest.fixture(scope="module")
def runs(corpus: Path, tmp_path_factory) -> dict[str, Path]:
    """One process at batch 8 and 2 FSDP2 ranks at batch 4 (the same global batch), 6 steps each."""
    base = tmp_path_factory.mktemp("fsdp2")
    args = common(corpus, base / "cache")
    one, two = base / "one", base / "two"
    assert train(compose([*args, "data.batch_size=8"]), one)["status"] == "completed"  # the reference, in this process
    res = drive([*args, "data.batch_size=4", *FSDP2], two, base)
    assert res.returncode == 0, res.stderr[-3000:]
    return {"one": one, "two": two, "base": base, "args": args}


@pytest.fixture(scope="module")
def interrupted(runs) -> Path:
    """The 2-rank run (batch 4 per rank) stopped by SIGTERM to rank 0 when step 2 starts (exit 3): its sharded
    checkpoint holds step 3. Each test continues its own copy."""
    run = runs["base"] / "interrupted"
    res = drive([*runs["args"], "data.batch_size=4", *FSDP2], run, runs["base"], at=2)
    assert res.returncode == 3, res.stderr[-3000:]
    return run


def test_fsdp2_figures_equal_one_process_on_the_same_global_batch(runs) -> None:
    """Losses, global and per-layer gradient norms, parameter norms, update ratios, activations, attention maps and
    the probe's output change: each rank holds half of every parameter and gradient, the logged figures are the
    whole model's (tolerance: fp32 summation order)."""
    one, two = runs["one"], runs["two"]
    summary = json.loads((two / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["world_size"] == 2
    for name in FIGURES:
        a, b = metric(one, name), metric(two, name)
        assert a.keys() == b.keys() and a, name
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-7), (name, step)
    assert summary["peak_grad_norm"] == pytest.approx(json.loads((one / "summary.json").read_text())[
        "peak_grad_norm"], rel=1e-5)


def test_fsdp2_checkpoint_is_sharded_and_consolidates_to_the_one_process_checkpoint(runs, tmp_path) -> None:
    """last.ckpt is a directory of one DCP shard per rank; `python -m lmlab.record.consolidate` makes the file a
    one-process run writes: the same weights and AdamW moments under the same keys, within fp32 rounding."""
    sharded = runs["two"] / "checkpoints" / "last.ckpt"
    assert sharded.is_dir() and {"__0_0.distcp", "__1_0.distcp", "meta.pt", ".metadata"} <= {
        p.name for p in sharded.iterdir()}
    res = cli("-m", "lmlab.record.consolidate", str(runs["two"]), str(tmp_path / "one_file.ckpt"), cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    mine = load_checkpoint(tmp_path / "one_file.ckpt", "test")  # weights_only=True
    ref = load_checkpoint(runs["one"] / "checkpoints" / "last.ckpt", "test")
    assert mine["state_dict"].keys() == ref["state_dict"].keys()
    for k, v in ref["state_dict"].items():
        torch.testing.assert_close(mine["state_dict"][k], v, rtol=1e-5, atol=1e-6, msg=k)
    (a,), (b,) = mine["optimizer_states"], ref["optimizer_states"]
    assert [g["params"] for g in a["param_groups"]] == [g["params"] for g in b["param_groups"]]
    assert [g["lr"] for g in a["param_groups"]] == [g["lr"] for g in b["param_groups"]]
    for i, s in b["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            scale = float(s[k].abs().max())  # near-zero moments differ by fp32 summation order, relative to the largest
            torch.testing.assert_close(a["state"][i][k], s[k], rtol=1e-4, atol=1e-4 * scale, msg=(i, k))
    assert mine["global_step"] == ref["global_step"] == 6


def test_eval_reads_the_sharded_run_and_its_consolidated_file(runs, tmp_path) -> None:
    """eval.py run= on the FSDP2 run (sharded, read in one process), and on a copy whose checkpoint is the
    consolidated file: the validation loss the run itself measured at its last step."""
    two = runs["two"]
    copy = tmp_path / "copy"
    shutil.copytree(two, copy, ignore=shutil.ignore_patterns("*.ckpt"))
    assert consolidate(two, copy / "checkpoints" / "last.ckpt") == copy / "checkpoints" / "last.ckpt"
    assert (copy / "checkpoints" / "last.ckpt").is_file()
    logged = json.loads((two / "summary.json").read_text())["final_val_loss"]
    res = cli(str(ROOT / "eval.py"), f"run={two}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads((two / "eval" / "eval.json").read_text())["rows"][0]["loss"] == pytest.approx(logged, rel=1e-5)
    assert evaluate(copy)["rows"][0]["loss"] == pytest.approx(logged, rel=1e-5)  # what eval.py run=<copy> runs


ENTRY_POINTS = {  # every command that reads a sharded checkpoint: (arguments, whether they take the run's own args)
    "eval": lambda run, tmp: [str(ROOT / "eval.py"), f"run={run}"],
    "export_hf": lambda run, tmp: [str(ROOT / "eval.py"), f"run={run}", "export=hf", f"out={tmp / 'hf'}"],
    "generate": lambda run, tmp: [str(ROOT / "generate.py"), f"run={run}", "prompt=The", "max_new_tokens=2"],
    "init_from": lambda run, tmp: [str(ROOT / "train.py"), f"init_from={run}", f"hydra.run.dir={tmp / 'new'}"],
    "consolidate": lambda run, tmp: ["-m", "lmlab.record.consolidate", str(run), str(tmp / "one.ckpt")],
    "resume": lambda run, tmp: [str(ROOT / "train.py"), *FSDP2, "data.batch_size=4", "trainer.max_steps=8",
                                f"hydra.run.dir={run}"],
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_a_hostile_sharded_checkpoint_is_refused_by_every_entry_point(runs, tmp_path, entry: str) -> None:
    """The reported exploit: a `.metadata` whose globals walk from torch.distributed.checkpoint to `operator`'s
    getters and on to `os`, in front of the genuine metadata (a reader that ran it would go on with normal numbers).
    Every command that reads the checkpoint refuses it naming the path, and the payload never runs. (The payload
    alone, and every other payload, alone and in front: tests/unit/record/test_hostile.py, at the reader all these
    commands call.)"""
    run = tmp_path / "run"
    shutil.copytree(runs["two"], run)
    ckpt, marker = run / "checkpoints" / "last.ckpt", tmp_path / "pwned"
    real = (ckpt / ".metadata").read_bytes()
    (ckpt / ".metadata").write_bytes(hostile("operator_chain", marker, real))
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    args = ENTRY_POINTS[entry](run, tmp_path)
    if args[0].endswith("train.py"):
        args = [args[0], *runs["args"], *args[1:]]
    res = cli(*args, cwd=tmp_path)
    assert res.returncode != 0 and not marker.exists(), res.stderr[-3000:]
    assert f"refused {ckpt}" in res.stderr and "is not allowed in a checkpoint's metadata" in res.stderr, \
        res.stderr[-3000:]
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


@pytest.mark.slow
def test_fsdp2_interrupted_by_sigterm_resumes_to_the_same_metrics(runs, interrupted) -> None:
    """SIGTERM at step 2 of 6 (through lmlab's interrupt machinery: both ranks stop after the step, the sharded
    checkpoint is saved), then train.py resume=auto: every figure of every row equals the uninterrupted run's. The
    same checkpoint consolidated in place continues in one process like the one-process run."""
    base, args = runs["base"], [*runs["args"], "data.batch_size=4", *FSDP2]
    summary = json.loads((interrupted / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["steps"] == 3, summary
    assert (interrupted / "checkpoints" / "last.ckpt" / "meta.pt").is_file()
    run, copy = base / "sigterm_resumed", base / "consolidated"
    shutil.copytree(interrupted, run)
    shutil.copytree(interrupted, copy)
    res = cli(str(ROOT / "train.py"), *args, f"hydra.run.dir={run}", cwd=base)
    assert res.returncode == 0, res.stderr[-3000:]
    assert figures(run) == figures(runs["two"])
    # The same checkpoint made one file in place continues in one process at batch 8: the one-process run's curve.
    res = cli("-m", "lmlab.record.consolidate", str(copy), str(copy / "checkpoints" / "last.ckpt"), cwd=base)
    assert res.returncode == 0 and (copy / "checkpoints" / "last.ckpt").is_file(), res.stderr[-3000:]
    res = cli(str(ROOT / "train.py"), *runs["args"], "data.batch_size=8", f"hydra.run.dir={copy}", cwd=base)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("train/loss", "grad/norm", "val/loss"):
        a, b = metric(runs["one"], name), metric(copy, name)
        assert a.keys() == b.keys(), name
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5), (name, step)


def test_a_checkpoint_consolidated_in_place_continues_on_fsdp2_ranks(runs, interrupted) -> None:
    """The README's "consolidate in place, then continue with any trainer" with trainer=fsdp2 (it ended in torch's
    RuntimeError: the one file's optimizer state re-keyed by the module's parameter order, not the optimizer's).
    Interrupted at step 3 of 6, made one file in place, continued on 2 FSDP2 ranks: the uninterrupted run's figures,
    and the run's checkpoint is sharded again."""
    base, args = runs["base"], [*runs["args"], "data.batch_size=4", *FSDP2]
    run = shutil.copytree(interrupted, base / "consolidated_then_fsdp2")
    ckpt = run / "checkpoints" / "last.ckpt"
    res = cli("-m", "lmlab.record.consolidate", str(run), str(ckpt), cwd=ROOT)
    assert res.returncode == 0 and ckpt.is_file(), res.stderr[-3000:]
    res = cli(str(ROOT / "train.py"), *args, f"hydra.run.dir={run}", cwd=base)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in FIGURES:
        a, b = metric(runs["two"], name), metric(run, name)
        assert a.keys() == b.keys() and a, name
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-7), (name, step)
    assert (ckpt / "meta.pt").is_file() and json.loads((run / "summary.json").read_text())["steps"] == 6


def test_a_resume_on_fewer_ranks_is_refused_unless_the_global_batch_is_kept(runs, interrupted, tmp_path) -> None:
    """FSDP2 2 -> 1 rank and the consolidated checkpoint -> one process, at the same per-rank batch (half the global
    batch): refused with exit 2, one line naming trainer.devices, both values and the commands, nothing written.
    On 1 FSDP2 rank at data.batch_size=8 the run goes on (DCP reshards 2 -> 1) on the 2-rank run's curve, and
    summary.json says what changed."""
    base, args = runs["base"], [*runs["args"], "data.batch_size=4"]
    one_rank = [a for a in FSDP2 if not a.startswith("trainer.devices")] + ["trainer.devices=1"]
    run = shutil.copytree(interrupted, base / "fewer_ranks")
    consolidated = tmp_path / "consolidated"
    shutil.copytree(runs["two"], consolidated)
    consolidate(consolidated, consolidated / "checkpoints" / "last.ckpt")
    for where, launch in ((run, one_rank), (consolidated, ["trainer.max_steps=8"])):
        before = sorted((p.relative_to(where), p.stat().st_mtime_ns) for p in where.rglob("*"))
        res = cli(str(ROOT / "train.py"), *args, *launch, f"hydra.run.dir={where}", cwd=base)
        error = res.stderr.strip().splitlines()[-1]
        assert res.returncode == 2 and "global batch is 8 sequences per step" in error, res.stderr[-3000:]
        assert "this launch's 4" in error and "trainer.devices: checkpoint 2, now 1" in error, error
        assert f"as it was: python train.py hydra.run.dir={where} trainer.devices=2" in error, error
        assert error.endswith("data.batch_size=8"), error
        assert sorted((p.relative_to(where), p.stat().st_mtime_ns) for p in where.rglob("*")) == before
    res = cli(str(ROOT / "train.py"), *args, *one_rank, "data.batch_size=8",
              f"hydra.run.dir={run}", cwd=base)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("grad/norm", "val/loss", "param/norm/layer_01"):
        a, b = metric(runs["two"], name), metric(run, name)
        assert a.keys() == b.keys() and a, name
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-7), (name, step)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["attempts"][-1]["changed"] == {
        "world_size": [2, 1], "devices": [2, 1], "batch_size": [4, 8]}
    assert summary["relaunched"] == "at step 3: world_size 2 -> 1, devices 2 -> 1, batch_size 4 -> 8"


def test_a_sharded_run_resumed_by_another_trainer_is_refused_naming_the_fix(runs, tmp_path) -> None:
    run = tmp_path / "run"
    shutil.copytree(runs["two"], run)
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    with pytest.raises(ValueError, match=r"sharded \(written by trainer=fsdp2\); continue it with trainer=fsdp2, "
                                         r"or .*python -m lmlab\.record\.consolidate .*last\.ckpt"):
        train(compose([*runs["args"], "data.batch_size=8", "trainer.max_steps=8"]), run)
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


def test_a_hybrid_stack_on_fsdp2_ranks_equals_one_process(runs) -> None:
    """mixer=gdn with an attention layer in two: each block sharded whatever its mixer, the figures (the recurrent
    layer's state norm among them) those of one process on the same global batch."""
    base, args = runs["base"], [*runs["args"], "mixer=gdn", "mixer.pattern=[gdn,attention]", "position=rope"]
    one, two = base / "hybrid_one", base / "hybrid_two"
    assert train(compose([*args, "data.batch_size=8"]), one)["status"] == "completed"
    res = drive([*args, "data.batch_size=4", *FSDP2], two, base)
    assert res.returncode == 0, res.stderr[-3000:]
    for name in ("train/loss", "grad/norm", "grad/norm/layer_00/mix", "grad/norm/layer_01/attn", "val/loss",
                 "mixer/state_norm/layer_00", "mixer/gate_mean/layer_00", "attn/entropy/layer_01"):
        a, b = metric(one, name), metric(two, name)
        assert a.keys() == b.keys() and a, name
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-7), (name, step)
