"""End to end on CPU: train.py -> run directory -> eval.py; resume continues the curve; divergence is a result."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import Callback

from lmlab import compose
from lmlab.run.training import train
from tests.runs import ROOT, CtrlC, metric, one_and_two_ranks, tiny
from tests.runs import cli as _cli


def test_train_leaves_a_run_directory(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(compose(tiny(corpus, tmp_path / "cache")), run, overrides=["model.n_layer=2"])
    for path in ("metrics.csv", "checkpoints/last.ckpt", "checkpoints/best.ckpt", "tokenizer.json",
                 "summary.json", "plots/grad_norm_at_init.png"):
        assert (run / path).exists(), path
    on_disk = json.loads((run / "summary.json").read_text())
    assert on_disk["status"] == summary["status"] == "completed"
    assert on_disk["steps"] == 30 and on_disk["tokens"] == 30 * 8 * 32
    assert on_disk["final_val_loss"] < on_disk["unigram_val_loss"]  # learnt more than token frequencies
    assert set(on_disk["grad_norm_at_init"]) == {"embed", "layer_00", "layer_01", "head"}
    header = (run / "metrics.csv").read_text().splitlines()[0].split(",")
    for name in ("train/loss", "val/loss", "val/ppl", "lr", "grad/norm", "grad/norm/layer_00/attn",
                 "grad/norm/layer_01/ffn", "grad/norm/embed", "param/norm/layer_00", "update/ratio/layer_01",
                 "act/rms/layer_01", "attn/entropy/layer_00", "attn/max_logit/layer_01", "train/loss_vs_unigram",
                 "update/output_change", "act/ratio/layer_00/attn", "act/ratio/layer_01/ffn"):
        assert name in header, name
    # Each figure sits at the step it was measured at (monitor every 5, attention every 10), never re-emitted at the
    # logging steps in between; the training curve is on every step (log_every_n_steps=1).
    for name, every in (("param/norm/layer_00", 5), ("update/ratio/layer_01", 5), ("act/rms/layer_01", 5),
                        ("grad/norm/layer_00/attn", 5), ("attn/entropy/layer_00", 10), ("update/output_change", 5),
                        ("act/ratio/layer_00/attn", 5), ("act/ratio/layer_01/ffn", 5)):
        assert sorted(metric(run, name)) == list(range(0, 30, every)), name
    assert sorted(metric(run, "train/loss")) == list(range(30))
    steps = [row.split(",")[0] for row in (run / "metrics.csv").read_text().splitlines()[1:]]
    assert len(steps) == len(set(steps))  # one row per step


def test_resume_continues_the_same_curve(corpus: Path, tmp_path: Path, tiny_straight: Path) -> None:
    cache, straight = tiny_straight.parent / "cache", tiny_straight
    resumed = tmp_path / "resumed"
    with pytest.raises(SystemExit):
        train(compose(tiny(corpus, cache)), resumed, callbacks=[CtrlC(at=17)])  # between two checkpoints
    interrupted = json.loads((resumed / "summary.json").read_text())
    assert interrupted["status"] == "interrupted" and interrupted["steps"] == 17
    summary = train(compose(tiny(corpus, cache, "resume=true")), resumed)
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 8 * 32
    a, b = metric(straight, "train/loss"), metric(resumed, "train/loss")
    assert sorted(a) == sorted(b)  # no step lost or logged twice
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), step  # same data order, same LR
    assert metric(resumed, "lr") == pytest.approx(metric(straight, "lr"))
    # A finished run trains on when resumed with more steps (the loader is infinite: no epoch may end it).
    longer = [a for a in tiny(corpus, cache, "resume=true") if not a.startswith("trainer.max_steps")]
    summary = train(compose([*longer, "trainer.max_steps=40"]), resumed)
    assert summary["steps"] == 40 and sorted(metric(resumed, "train/loss")) == list(range(40))


class CtrlCAfterTheStep(Callback):
    """Ctrl-C pressed twice lands after the optimizer step of step `at` - 1, before its row is logged."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            raise KeyboardInterrupt


@pytest.mark.parametrize("at", [17, 20], ids=["mid", "validation_due"])
def test_a_stop_after_the_optimizer_step_resumes_without_training_that_batch_again(corpus, tmp_path, at,
                                                                                    tiny_straight) -> None:
    """The checkpoint of a stop inside a step holds the weights after its optimizer step: the resumed run goes on
    from the next batch (it trained batch `at` - 1 again, a step more than the straight run, each row a step late).
    The stopped step's own row was never logged; every other row equals the straight run's."""
    cache, straight, resumed = tiny_straight.parent / "cache", tiny_straight, tmp_path / "resumed"
    with pytest.raises(SystemExit):
        train(compose(tiny(corpus, cache)), resumed, callbacks=[CtrlCAfterTheStep(at=at)])
    assert json.loads((resumed / "summary.json").read_text())["steps"] == at
    summary = train(compose(tiny(corpus, cache, "resume=true")), resumed)
    assert summary["steps"] == 30 and summary["tokens"] == 30 * 8 * 32
    a, b = metric(straight, "train/loss"), metric(resumed, "train/loss")
    assert sorted(b) == [s for s in range(30) if s != at - 1]
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), step
    a, b = metric(straight, "val/loss"), metric(resumed, "val/loss")  # validated at the same steps, on same weights
    assert sorted(b) == [s for s in sorted(a) if s != at - 1] and all(b[s] == pytest.approx(a[s], rel=1e-4) for s in b)


def test_divergence_is_a_result_not_a_crash(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    summary = train(compose(tiny(corpus, tmp_path / "cache", "optim.lr=1e3", "optim.grad_clip=0")), run)
    assert summary["status"] == "diverged"
    assert summary["diverged_at_step"] is not None and summary["diverged_at_step"] < 30
    assert json.loads((run / "summary.json").read_text())["status"] == "diverged"
    assert len(metric(run, "train/loss")) >= 1  # what was logged is kept
    assert (run / "checkpoints" / "last.ckpt").exists()


def test_cli_train_then_eval(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "cli_run"
    res = _cli(str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache"), f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert (run / ".hydra" / "config.yaml").exists() and (run / ".hydra" / "overrides.yaml").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed"
    res = _cli(str(ROOT / "eval.py"), f"run={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((run / "eval" / "eval.json").read_text())["rows"]
    assert rows[0]["length"] == 32 and rows[0]["loss"] == pytest.approx(summary["final_val_loss"], abs=1e-3)
    # `rope_scaling=` is a config group in train.py; on eval's command line it is the list of methods
    res = _cli(str(ROOT / "eval.py"), f"run={run}", "rope_scaling=none", "lengths=16,32", f"out={tmp_path / 'e'}",
               cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads((tmp_path / "e" / "eval.json").read_text())["rows"]
    assert [(r["length"], r["rope_scaling"]) for r in rows] == [(16, "none"), (32, "none")]


def test_multirun_goes_on_after_a_diverging_job(corpus: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    args = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith("trainer.max_steps")]
    res = _cli(str(ROOT / "train.py"), "-m", *args, "trainer.max_steps=20", "optim.grad_clip=0",
               "optim.lr=1e3,3e-3", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    statuses = {json.loads(p.read_text())["overrides"][-1]: json.loads(p.read_text())["status"]
                for p in sweep.rglob("summary.json")}
    assert statuses == {"optim.lr=1000.0": "diverged", "optim.lr=0.003": "completed"}
    res = _cli(str(ROOT / "eval.py"), f"compare={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    table = (sweep / "compare.md").read_text()
    assert "diverged" in table and "completed" in table and "optim.lr" in table
    for png in ("train_loss.png", "val_loss.png", "grad_norm.png", "grad_norm_at_init.png"):
        assert (sweep / "plots" / png).stat().st_size > 1000, png
    job = next(p.parent for p in sweep.rglob("summary.json") if "optim.lr=0.003" in p.read_text())
    assert "=" in job.name and "," in job.name  # Hydra names sweep jobs by their overrides
    res = _cli(str(ROOT / "eval.py"), f"run={job}", cwd=tmp_path)  # such a path must still work as run=
    assert res.returncode == 0, res.stderr[-3000:]
    assert (job / "eval" / "eval.md").exists()


def test_ddp_figures_equal_one_process_on_the_same_global_batch(corpus: Path, tmp_path: Path) -> None:
    """2 CPU ranks x batch 4 (gloo) against 1 process x batch 8: the same global batch, the same figures."""
    common = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "data.batch"))]
    common += ["trainer.max_steps=3", "trainer.val_check_interval=3", "monitor.every_n_steps=1",
               "monitor.attn_every_n_steps=1", "optim.grad_clip=0"]
    one, two = one_and_two_ranks(common, tmp_path)
    assert json.loads((two / "summary.json").read_text())["world_size"] == 2
    for name in ("train/loss", "grad/norm", "grad/norm/layer_00/attn", "grad/norm/layer_01/ffn", "grad/norm/embed",
                 "param/norm/layer_01", "update/ratio/layer_00", "act/rms/layer_01", "attn/entropy/layer_00",
                 "attn/max_logit/layer_01", "val/loss", "update/output_change", "act/ratio/layer_00/attn",
                 "act/ratio/layer_01/ffn"):
        a, b = metric(one, name), metric(two, name)
        assert a.keys() == b.keys() and a, name
        for step in a:
            assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-6), (name, step)


def test_resume_refuses_another_architecture(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=2")), run)
    with pytest.raises(ValueError, match=r"resume=true .*model/norm: checkpoint has .*'layer'.*config has .*'rms'"):
        train(compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=4", "norm=rms", "resume=true")), run)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_optimizer_steps_on_clipped_gradients(corpus: Path, tmp_path: Path, monkeypatch, precision: str) -> None:
    """fp32 and bf16-mixed (CPU autocast) with the default fused AdamW, which Lightning's bf16 plugin refuses to
    clip for: the optimizer steps on gradients clipped to optim.grad_clip (by the norm LitGPT already took),
    grad/norm logs the norm before clipping, and summary.json's peak_grad_norm is the largest of those."""
    import torch

    seen: list[tuple[bool, float]] = []
    step = torch.optim.AdamW.step

    def recording_step(self, closure=None):  # Lightning passes forward + backward + clipping as the closure
        with torch.enable_grad():
            closure()
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        seen.append((bool(self.defaults["fused"]), torch.linalg.vector_norm(torch.stack(
            [g.float().norm() for g in grads])).item()))
        return step(self)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    run = tmp_path / "run"
    summary = train(compose(tiny(corpus, tmp_path / "cache", f"trainer.precision={precision}", "optim.grad_clip=0.05",
                                 "trainer.max_steps=4", "trainer.val_check_interval=4")), run)
    assert summary["status"] == "completed" and len(seen) == 4
    assert all(fused for fused, _ in seen)
    assert max(n for _, n in seen) <= 0.05 * 1.001
    logged = metric(run, "grad/norm")
    assert len(logged) == 4 and min(logged.values()) > 0.05  # clipping had work to do on every step
    assert summary["peak_grad_norm"] == pytest.approx(max(logged.values()), rel=1e-6)


def test_progress_bar_counts_steps_not_an_epoch_budget(corpus: Path, tmp_path: Path, monkeypatch) -> None:
    """Training by steps leaves Lightning's max_epochs at -1; its Rich bar said 'Epoch 0/-2'."""
    from lightning.pytorch.callbacks import ProgressBar

    import lmlab.run.progress

    monkeypatch.setattr(lmlab.run.progress, "_on_a_terminal", lambda: True)  # the bar is for terminals

    seen: list[str] = []

    class Spy(Callback):
        def on_train_batch_end(self, trainer, *args) -> None:
            bar = next(c for c in trainer.callbacks if isinstance(c, ProgressBar))
            seen.append(bar._get_train_description(trainer.current_epoch) if hasattr(bar, "_get_train_description")
                        else bar.train_progress_bar.desc)

    cfg = compose(tiny(corpus, tmp_path / "cache", "trainer.max_steps=2", "trainer.enable_progress_bar=true"))
    train(cfg, tmp_path / "run", callbacks=[Spy()])
    assert seen and seen[-1].strip() == "Epoch 0"


def test_a_run_continues_from_its_own_directory_with_its_own_overrides(corpus: Path, tmp_path: Path) -> None:
    """`python train.py norm=rms ffn=swiglu ... hydra.run.dir=X trainer.max_steps=30`, then `python train.py
    hydra.run.dir=X trainer.max_steps=40`: the second takes the run's saved overrides and changes only the steps (it
    was refused: the default architecture did not match the checkpoint's). An architecture change is refused by key."""
    run = tmp_path / "run"
    first = _cli(str(ROOT / "train.py"), *tiny(corpus, tmp_path / "cache", "norm=rms", "ffn=swiglu"),
                f"hydra.run.dir={run}", cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    again = _cli(str(ROOT / "train.py"), f"hydra.run.dir={run}", "trainer.max_steps=40", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 40
    assert summary["model"]["norm"]["name"] == "rms" and summary["model"]["ffn"]["name"] == "swiglu"
    assert sorted(metric(run, "train/loss")) == list(range(40))
    assert "trainer.max_steps=40" in summary["overrides"] and "norm=rms" in summary["overrides"]
    assert "trainer.max_steps=30" not in summary["overrides"]
    said = again.stdout.splitlines()[0]  # the first line says what happens, naming what it kept and changed
    assert said.startswith(f"continuing {run} from step 30, its overrides kept: ") and \
        " norm=rms ffn=swiglu;" in said and said.endswith("; this command's: trainer.max_steps=40"), again.stdout[:2000]
    assert "Checkpoint directory" not in again.stderr
    changed = _cli(str(ROOT / "train.py"), f"hydra.run.dir={run}", "norm=layer", "trainer.max_steps=50", cwd=tmp_path)
    assert changed.returncode != 0 and "model/norm: checkpoint has {'name': 'rms'" in changed.stderr, \
        changed.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["steps"] == 40  # refused: nothing changed


def test_off_a_terminal_progress_is_plain_lines(corpus: Path, tmp_path: Path) -> None:
    """Under nohup, SLURM or a log file a bar is one final frame: train.py prints a line every few steps and at each
    validation instead, with the step, the total, the loss and the time left."""
    import re

    run = tmp_path / "run"
    args = tiny(corpus, tmp_path / "cache", "trainer.max_steps=40", "trainer.enable_progress_bar=true")
    res = _cli(str(ROOT / "train.py"), *args, f"hydra.run.dir={run}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    steps = re.findall(r"^step (\d+)/40  loss \d+\.\d{4}.*eta \d+s$", res.stdout, flags=re.M)
    assert steps == [str(s) for s in range(2, 41, 2)], res.stdout[-2000:]  # every 40 // 20 = 2 steps
    assert re.findall(r"^val at step (\d+): loss \d+\.\d{4}$", res.stdout, flags=re.M) == ["10", "20", "30", "40"]


class CtrlCTwiceInTheBookkeeping(Callback):
    """Two real SIGINTs (Ctrl-C pressed twice) after the optimizer step of step `at` - 1, while Lightning logs its row
    (`log`) or steps the schedule (`schedule`): the windows where a stop at once cut the step's bookkeeping short."""

    def __init__(self, at: int, where: str) -> None:
        self.at, self.where = at, where

    def on_train_start(self, trainer, pl_module) -> None:
        owner, name = ((trainer._logger_connector, "update_train_step_metrics") if self.where == "log"
                       else (trainer.fit_loop.epoch_loop, "update_lr_schedulers"))
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if trainer.global_step == self.at:
                os.kill(os.getpid(), signal.SIGINT)
                os.kill(os.getpid(), signal.SIGINT)
            return original(*args, **kwargs)

        setattr(owner, name, wrapped)


@pytest.mark.parametrize("where", ["log", "schedule"])
def test_ctrl_c_twice_after_the_optimizer_step_stops_at_its_boundary_and_resumes_exactly(corpus, tmp_path, where,
                                                                                         tiny_straight) -> None:
    """Pressed twice once the step's optimizer step is done, Ctrl-C stops at the step's boundary: the resumed run is
    the straight one, every row (cut inside the bookkeeping, its rows came a step late or its schedule a step
    behind)."""
    cache, straight, resumed = tiny_straight.parent / "cache", tiny_straight, tmp_path / "resumed"
    summary = train(compose(tiny(corpus, cache)), resumed, callbacks=[CtrlCTwiceInTheBookkeeping(17, where)])
    assert (summary["status"], summary["steps"], summary["signal"]) == ("interrupted", 17, signal.SIGINT)
    train(compose(tiny(corpus, cache, "resume=true")), resumed)
    a, b = metric(straight, "train/loss"), metric(resumed, "train/loss")
    assert sorted(b) == sorted(a) == list(range(30))
    for step in b:
        assert b[step] == pytest.approx(a[step], rel=1e-4, abs=1e-5), step
