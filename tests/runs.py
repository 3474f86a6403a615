"""Shared helpers for tests that train: a small corpus with structure, the tiny run's overrides, the CLI."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from lightning.pytorch.callbacks import Callback

from lmlab import compose
from lmlab.run.training import train

ROOT = Path(__file__).resolve().parent.parent
WORDS = "the king queen lord lady sword crown night day love death speak hear thou thee shall will not".split()


def write_corpus(d: Path) -> Path:
    """~60 kB of text with structure to learn (a small grammar over a few words), two files."""
    import random

    rng = random.Random(0)
    d.mkdir(parents=True, exist_ok=True)
    for name in ("a.txt", "b.txt"):
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))).capitalize() + "." for _ in range(900)]
        (d / name).write_text("\n".join(lines) + "\n")
    return d


def tiny(corpus: Path, cache: Path, *extra: str) -> list[str]:
    return ["data=text_files", f"data.paths=[{corpus}]", f"data.cache_dir={cache}", "data.batch_size=8",
            "data.val_windows=32", "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.max_seq_len=32",
            "trainer.max_steps=30", "trainer.val_check_interval=10", "trainer.log_every_n_steps=1",
            "trainer.enable_progress_bar=false", "monitor.every_n_steps=5", "monitor.attn_every_n_steps=10",
            "schedule.warmup_steps=5", "logger=none", "threads=1", *extra]


def metric(run: Path, name: str) -> dict[int, float]:
    with open(run / "metrics.csv") as f:
        return {int(r["step"]): float(r[name]) for r in csv.DictReader(f) if r.get(name)}


def metric_rows(run: Path) -> dict[int, dict[str, str]]:
    """metrics.csv by step: every metric logged at that step (its rows merged), empty cells left out."""
    rows: dict[int, dict[str, str]] = {}
    with open(run / "metrics.csv") as f:
        for r in csv.DictReader(f):
            rows.setdefault(int(r["step"]), {}).update({k: v for k, v in r.items() if v})
    return rows


def figures(run: Path) -> list[dict[str, str]]:
    """metrics.csv's rows as text, every column but `perf/` (wall-clock speed and memory: the machine's figures,
    which differ between any two runs)."""
    with open(run / "metrics.csv", newline="") as f:
        return [{k: v for k, v in row.items() if not k.startswith("perf/")} for row in csv.DictReader(f)]


def cli(*args: str, cwd: Path, timeout: float = 600, fresh: bool = False) -> subprocess.CompletedProcess:
    """`python args...` in `cwd`, one CPU thread, its output captured. An lmlab command of this checkout that runs under
    Hydra runs in a fork of this worker's warm interpreter (tests/warm.py: the same process state, its imports already
    made) unless `fresh` (a README command, as a user types it) or LMLAB_TEST_WARM=0; anything else in a new
    interpreter."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if not fresh and os.environ.get("LMLAB_TEST_WARM", "1") != "0":
        from tests.warm import runs_warm

        if runs_warm(list(args), str(cwd)) and (res := warm(env).run(list(args), str(cwd), env, timeout)) is not None:
            return res
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


_WARM: list = []  # this worker's warm interpreter, once started


def warm(env: dict[str, str]):
    """This worker's warm interpreter for a command under `env`: started under it, and started again under a command's
    environment that differs from its own (a test or a run in this worker set a variable since, which an import may
    read), but for the variables no import reads (tests.warm.RUNTIME_ONLY)."""
    from tests.warm import Warm

    if _WARM and not _WARM[0].imported_under(env):
        _WARM.pop().close()
    if not _WARM:
        _WARM.append(Warm(env))
    return _WARM[0]



TWO_RANKS = {"ddp": ("trainer.strategy=ddp",), "fsdp2": ("trainer=fsdp2", "trainer.precision=32-true")}


def one_and_two_ranks(args: list[str], tmp_path: Path, strategy: str = "ddp") -> tuple[Path, Path]:
    """`args` twice on the same global batch: one process x batch 8 (run dir tmp_path/one), trained in this process
    (the reference: no second interpreter to start), then train.py on 2 CPU ranks x batch 4 (tmp_path/two) under
    `strategy` (ddp, or fsdp2 in fp32); both must complete. `args` sets no data.batch_size."""
    one, two = tmp_path / "one", tmp_path / "two"
    summary = train(compose([*args, "data.batch_size=8", "trainer.accelerator=cpu"]), one)
    assert summary["status"] == "completed", summary
    res = cli(str(ROOT / "train.py"), *args, "data.batch_size=4", *TWO_RANKS[strategy], "trainer.accelerator=cpu",
              "trainer.devices=2", f"hydra.run.dir={two}", cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    return one, two


class CtrlC(Callback):
    """Presses Ctrl-C before the step `at` starts (Lightning turns it into SystemExit after its shutdown)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.at:
            raise KeyboardInterrupt


def straight_and_resumed(corpus: Path, tmp_path: Path, *extra: str, at: int = 17,
                         watch: tuple[Callback, Callback] | None = None) -> tuple[Path, Path]:
    """The tiny run with `extra` overrides trained straight through, and again with Ctrl-C before step `at` and a
    resume=true: the two run directories (the pair a resume must make equal). `watch`: a callback for the straight
    run and one for both attempts of the resumed run."""
    import pytest

    from lmlab import compose
    from lmlab.run.training import train

    cache = tmp_path / "cache"
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    first, second = ([w] for w in watch) if watch else ([], [])
    train(compose(tiny(corpus, cache, *extra)), straight, callbacks=first)
    with pytest.raises(SystemExit):
        train(compose(tiny(corpus, cache, *extra)), resumed, callbacks=[*second, CtrlC(at=at)])
    train(compose(tiny(corpus, cache, *extra, "resume=true")), resumed, callbacks=second)
    return straight, resumed


def lmlab_checkpoint() -> dict:
    """The shape of an lmlab checkpoint: weights, one optimizer, the model config."""
    import torch

    return {"state_dict": {"model.wte.weight": torch.arange(20.0).view(5, 4)},
            "hyper_parameters": {"model": {"n_layer": 1}},
            "optimizer_states": [{"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.zeros(5, 4)}},
                                  "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]}],
            "global_step": 3}


def sharded_checkpoint(path: Path) -> Path:
    """A DCP checkpoint directory as FSDP2Strategy writes it (one process): the weights and optimizer through DCP,
    the rest in meta.pt."""
    import torch
    import torch.distributed.checkpoint as dcp

    from lmlab.record.sharded import META

    ckpt = lmlab_checkpoint()
    optim = {"state": {"model.wte.weight": ckpt["optimizer_states"][0]["state"][0]},
             "param_groups": [{**ckpt["optimizer_states"][0]["param_groups"][0], "params": ["model.wte.weight"]}]}
    dcp.save({"state_dict": ckpt["state_dict"], "optimizer_0": optim}, checkpoint_id=path, no_dist=True)
    torch.save({k: v for k, v in ckpt.items() if k not in ("state_dict", "optimizer_states")}, path / META)
    return path


class SlowUnit:
    """A corpus unit whose documents arrive slowly (a worker busy with it for `seconds`): for killing a tokenizing
    worker mid-shard. Importable, so the pool's processes can unpickle it."""

    def __init__(self, seconds: float, name: str = "slow") -> None:
        self.seconds, self.name = seconds, name

    def describe(self) -> str:
        return f"the slow unit {self.name}"

    def documents(self):
        import time

        def pieces():
            for _ in range(int(self.seconds / 0.05)):
                time.sleep(0.05)
                yield "the king speaks. " * 10

        yield pieces()
