"""What W&B will show, read back with W&B's own reader of offline runs (`wandb leet inspect`): one W&B run per
job of a sweep, each with its own config, history and summary; a resumed run continues its W&B run; a diverged run
says so; eval joins its training run's group. Plus run and group naming, the online/offline choice and the live
throughput figures. Every test runs W&B offline (conftest sets WANDB_MODE=offline)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lmlab import compose
from lmlab.run.training import train
from tests.runs import ROOT, CtrlC, cli, metric, tiny

STEPS = ["trainer.max_steps=6", "trainer.val_check_interval=3"]


def wandb_tiny(corpus: Path, cache: Path, *extra: str) -> list[str]:
    """tiny() with W&B as the logger and a handful of steps."""
    keep = [a for a in tiny(corpus, cache) if not a.startswith(("logger=", "trainer.max_steps", "trainer.val_check"))]
    return [*keep, *STEPS, "logger=wandb", *extra]


def leet(*args: str) -> str:
    """`wandb leet ...` (W&B's own reader of the transaction log a run writes)."""
    res = subprocess.run([sys.executable, "-m", "wandb", "leet", *args], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def wandb_runs(root: Path) -> list[dict]:
    """Every W&B run file under `root` as W&B shows it: `leet inspect --summary --json` (state, config, summary,
    tags) plus, from the records, the run record (group, job_type, display name) and the history rows."""
    out = []
    for f in sorted(root.rglob("run-*.wandb")):
        if "latest-run" in f.parts:
            continue  # a symlink to one of the others
        summary = json.loads(leet("inspect", "--summary", "--json", str(f)))
        records = [json.loads(line) for line in leet("inspect", "--json", str(f)).splitlines() if line.strip()]
        run = {}
        for r in records:  # the first run record, then updates (tags set at the end)
            if r["type"] == "run":
                run.update({k: v for k, v in r["run"].items() if v not in (None, "", [])})
        summary["record"] = run
        summary["history"] = [r["history"]["item"] for r in records if r["type"] == "history"]
        summary["path"] = f
        out.append(summary)
    return sorted(out, key=lambda s: s["start_time"])


def steps_of(run: dict, name: str) -> list[int]:
    return [int(h["trainer/global_step"]) for h in run["history"] if name in h]


# --- end to end -------------------------------------------------------------------------------------------------

def test_an_in_process_sweep_gives_one_wandb_run_per_job(corpus: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    res = cli(str(ROOT / "train.py"), "-m", *wandb_tiny(corpus, tmp_path / "cache"), "seed=1,2",
              f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = sorted(p.parent for p in sweep.rglob("summary.json"))
    assert len(jobs) == 2
    runs = {job: wandb_runs(job) for job in jobs}
    assert all(len(r) == 1 for r in runs.values()), {str(j): [str(x["path"]) for x in r] for j, r in runs.items()}
    ids = {r[0]["run_id"] for r in runs.values()}
    assert len(ids) == 2  # not one run reused by the second job
    groups = set()
    for job, (run,) in runs.items():
        summary = json.loads((job / "summary.json").read_text())
        seed = summary["config"]["seed"]
        config = run["config"]
        assert config["seed"] == seed and f"seed={seed}" in config["overrides"]
        assert config["overrides"] == summary["overrides"]
        assert config["n_params"] == summary["n_params"] and config["lmlab_version"]
        assert "git_commit" in config and config["model"]["n_layer"] == 2
        assert run["record"]["job_type"] == "train" and f"seed={seed}" in run["record"]["display_name"]
        groups.add(run["record"]["run_group"])
        assert steps_of(run, "train/loss") == list(range(6))  # its own history, not both jobs'
        assert run["summary"]["status"] == "completed" == summary["status"]
        assert run["summary"]["final_val_loss"] == pytest.approx(summary["final_val_loss"])
        assert run["summary"]["tokens_per_s"] == pytest.approx(summary["tokens_per_s"])
        assert "completed" in run["tags"] and run["state"] == "finished"
        assert f"seed={seed}" in run["tags"]  # the swept key's value: W&B groups the sweep's runs by it
    assert groups == {"sweep"}  # the sweep's directory name (no experiment)
    assert "wandb sync" in res.stdout and "wandb leet" in res.stdout


@pytest.mark.slow  # three Python processes (~25 s on two busy cores): `make test-all`
def test_a_submitit_sweep_gives_one_wandb_run_per_job(corpus: Path, tmp_path: Path) -> None:
    """hydra/launcher=local: each job in its own process (submitit), the same rule: one W&B run each, one group."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher")
    sweep = tmp_path / "sweep"
    res = cli(str(ROOT / "train.py"), "-m", "hydra/launcher=local", *wandb_tiny(corpus, tmp_path / "cache"),
              "seed=1,2", f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    jobs = sorted(p.parent for p in sweep.rglob("summary.json"))
    runs = [wandb_runs(job) for job in jobs]
    assert len(jobs) == 2 and [len(r) for r in runs] == [1, 1]
    assert len({r[0]["run_id"] for r in runs}) == 2
    assert {r[0]["record"]["run_group"] for r in runs} == {"sweep"}
    assert sorted(r[0]["config"]["seed"] for r in runs) == [1, 2]
    assert all(r[0]["summary"]["status"] == "completed" for r in runs)


def test_a_resumed_run_continues_its_wandb_run(corpus: Path, tmp_path: Path) -> None:
    cache, run = tmp_path / "cache", tmp_path / "run"
    args = [a for a in wandb_tiny(corpus, cache) if not a.startswith("trainer.max_steps")] + ["trainer.max_steps=10"]
    with pytest.raises(SystemExit):
        train(compose(args), run, callbacks=[CtrlC(at=7)])
    summary = train(compose([*args, "resume=true"]), run)
    assert summary["status"] == "completed" and summary["steps"] == 10
    first, second = wandb_runs(run)
    assert first["run_id"] == second["run_id"]  # the same W&B run, continued
    assert first["summary"]["status"] == "interrupted" and second["summary"]["status"] == "completed"
    assert steps_of(first, "train/loss") == list(range(7))
    assert steps_of(second, "train/loss") == list(range(7, 10))  # the history goes on at the next step
    assert "completed" in second["tags"] and "interrupted" not in second["tags"]
    # overwrite=true starts a new W&B run
    train(compose([*args, "resume=false", "overwrite=true"]), run)
    (fresh,) = wandb_runs(run)
    assert fresh["run_id"] != first["run_id"] and steps_of(fresh, "train/loss") == list(range(10))


def test_a_diverged_run_says_so_in_wandb(corpus: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    args = [a for a in wandb_tiny(corpus, tmp_path / "cache") if not a.startswith("trainer.max_steps")]
    summary = train(compose([*args, "trainer.max_steps=30", "optim.lr=1e3", "optim.grad_clip=0"]), run)
    assert summary["status"] == "diverged"
    (w,) = wandb_runs(run)
    assert w["summary"]["status"] == "diverged" and "diverged" in w["tags"]
    assert w["summary"]["diverged_at_step"] == summary["diverged_at_step"]
    assert w["summary"]["divergence_reason"] == summary["divergence_reason"]
    assert w["summary"]["unigram_val_loss"] == pytest.approx(summary["unigram_val_loss"])
    assert w["state"] == "finished"  # a result, not a crash


def test_eval_joins_its_training_runs_group(corpus: Path, tmp_path: Path) -> None:
    from lmlab.analysis.evaluate import evaluate

    run = tmp_path / "run"
    train(compose(wandb_tiny(corpus, tmp_path / "cache")), run, overrides=["norm=layer"])
    evaluate(run, out_dir=run / "eval")
    runs = wandb_runs(run)
    (trained,) = [r for r in runs if r["record"].get("job_type") == "train"]
    (evaluated,) = [r for r in runs if r["record"].get("job_type") == "eval"]
    assert evaluated["record"]["run_group"] == trained["record"]["run_group"]
    assert evaluated["record"]["display_name"] == f"eval:{trained['record']['display_name']}"
    assert evaluated["config"]["train_run_id"] == trained["run_id"]


def test_live_throughput_at_every_logging_step(corpus: Path, tmp_path: Path) -> None:
    from lmlab.model.flops import FLOPS_FORMULA, flops_per_token

    args = [a for a in tiny(corpus, tmp_path / "cache") if not a.startswith(("trainer.max_steps", "trainer.log_every"))]
    run = tmp_path / "run"
    train(compose([*args, "trainer.max_steps=6", "trainer.log_every_n_steps=2"]), run)
    tps, mem = metric(run, "perf/tokens_per_s"), metric(run, "perf/max_memory")
    assert sorted(tps) == sorted(mem) == sorted(metric(run, "train/loss")) == [1, 3, 5]  # Lightning's logging steps
    assert all(v > 0 for v in tps.values()) and all(v > 0.01 for v in mem.values())  # GiB: the process's peak RSS
    assert not metric(run, "perf/mfu")  # a CPU has no known peak: no MFU
    run = tmp_path / "run2"
    summary = train(compose([*args, "trainer.max_steps=6", "trainer.log_every_n_steps=1", "perf.peak_flops=1e12"]),
                    run)
    mfu, tps = metric(run, "perf/mfu"), metric(run, "perf/tokens_per_s")
    from lmlab.config import arch_config
    from lmlab.model.gpt import GPT

    flops = flops_per_token(GPT(arch_config(compose(args), vocab_size=summary["model"]["vocab_size"])), 32)["train"]
    assert sorted(mfu) == list(range(6)) and "6*N" in FLOPS_FORMULA
    for step in mfu:
        assert mfu[step] == pytest.approx(tps[step] * flops / 1e12, rel=1e-6)
