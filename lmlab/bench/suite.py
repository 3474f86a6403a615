"""The GPU check (scripts/bench_gpu.sh) as data: the machine it ran on, the JSON each stage writes, and one summary.

    python -m lmlab.bench env --json out/env.json          # the environment: versions, device, commit
    python -m lmlab.bench summary out                      # every stage's headline figures and the issue's targets

`FILES` names each stage's JSON file and the keys it must hold (the dry run's test checks them, docs/bench.md lists
them); `summary` reads whichever files are in the folder, writes `summary.json` (tokens/s, MFU, peak memory and the
step's breakdown per stage, the targets met or missed, the stages failed or not run) and prints it as a table; it
exits 1 when a stage's JSON lacks a key or its train.py run failed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from lmlab.bench.report import write_json

ROOT = Path(__file__).resolve().parents[2]
BENCH = ("date", "torch", "device", "precision", "compile", "overrides", "batch", "seq_len", "results", "ratios",
         "breakdown", "mfu_vs_spec_peak", "targets")
TRAIN = ("name", "overrides", "rc", "wall_s", "tokens_per_s", "mfu", "max_memory_gib", "logged", "summary")
# Each stage of the plan: its JSON file and the top-level keys it holds.
FILES = {
    "env": ("env.json", ("date", "commit", "python", "torch", "cuda", "device", "device_name", "dry_run")),
    "eager": ("gpt2-124m-eager.json", BENCH),
    "compiled": ("gpt2-124m-compiled.json", BENCH),
    "train-eager": ("train-eager.json", TRAIN),
    "train-compiled": ("train-compiled.json", TRAIN),
    "fsdp2": ("train-fsdp2.json", TRAIN),
    "attention": ("attention.json", ("date", "rows", "kv_cache")),
    "moe": ("moe.json", ("date", "device", "precision", "rows")),
    "mixers": ("mixers.json", ("date", "device", "rows")),
    "fp8": ("train-fp8.json", TRAIN),
}
ROW_KEYS = {"attention": ("T", "kind", "tokens_per_s", "step_s", "peak_growth_mb", "train_flops", "vs_full_per_flop"),
            "moe": ("name", "train_tok_s", "step_vs_dense", "fwd_bwd_vs_dense", "peak_mem_mb", "router_share"),
            "mixers": ("T", "kind", "requested", "backend", "tokens_per_s", "step_s", "peak_growth_mb",
                       "vs_attention")}
# The issue's GPU targets: MFU of the compiled step, the compiled lead over HF, masked attention per FLOP against full
# causal, an MoE step against the dense one at equal active FLOPs.
TARGETS = {"mfu_compiled": 0.50, "vs_hf_compiled": 1.30, "masked_vs_full_per_flop": 1.20, "moe_vs_dense": 1.50,
           "gdn_kernel_long": 1.0, "gdn_kernel_short": 2.0, "train_vs_bare": 0.90}


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def env_info(dry_run: bool = False) -> dict[str, Any]:
    """Versions, the device and the commit the figures belong to."""
    import torch

    out: dict[str, Any] = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "commit": _git("rev-parse",
                           "HEAD"), "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
                           "python": platform.python_version(), "torch": torch.__version__,
                           "cuda": torch.version.cuda, "cpu": platform.processor() or platform.machine(),
                           "cpu_threads": torch.get_num_threads(), "dry_run": dry_run}
    for pkg, dist in (("lightning", "lightning"), ("transformers", "transformers"), ("hydra", "hydra-core"),
                      ("triton", "triton")):  # the installed distribution's version: nothing imported (seconds)
        try:
            out[pkg] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    cuda = torch.cuda.is_available() and not dry_run
    out["device"] = "cuda" if cuda else "cpu"
    out["device_name"] = torch.cuda.get_device_name() if cuda else out["cpu"]
    if cuda:
        props = torch.cuda.get_device_properties(0)
        out |= {"device_count": torch.cuda.device_count(), "device_memory_gib": props.total_memory / 2**30,
                "cudnn": torch.backends.cudnn.version(), "capability": f"{props.major}.{props.minor}"}
        try:
            out["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out["nvidia_smi"] = None
    return out


def missing_keys(stage: str, data: dict[str, Any]) -> list[str]:
    """The keys FILES (and ROW_KEYS for each row) name that `data`, a stage's JSON, lacks."""
    lack = [k for k in FILES[stage][1] if k not in data]
    for i, row in enumerate(data.get("rows", []) if stage in ROW_KEYS else []):
        lack += [f"rows[{i}].{k}" for k in ROW_KEYS[stage] if k not in row]
    return lack


def _bench_line(data: dict[str, Any]) -> dict[str, Any]:
    ours = data["results"]["lmlab"]
    peer = next((k for k in data["ratios"] if k.startswith("train_vs_")), None)
    return {"tokens_per_s": ours["train_tok_s"], "mfu": (data.get("mfu_vs_spec_peak") or {}).get("lmlab"),
            "mfu_vs_measured_mm": ours["train_mfu"], "peak_mem_gib": (ours["peak_mem_mb"] or 0) / 1024,
            "vs_hf": data["ratios"][peer]["median"] if peer else None,
            "breakdown_ms": {k: v * 1e3 for k, v in (data.get("breakdown") or {}).get("lmlab", {})
                             .get("seconds", {}).items()}}


def summarize(out_dir: Path) -> dict[str, Any]:
    """Headline figures per stage found in `out_dir`, the issue's targets, the stages whose JSON is incomplete or whose
    run failed (`problems`), and those with no JSON (`missing`)."""
    stages: dict[str, Any] = {}
    problems: dict[str, str] = {}
    missing = []  # stages not run (yet): the plan runs in two calls, each summarised
    for stage, (file, _) in FILES.items():
        path = out_dir / file
        if not path.is_file():
            missing.append(stage)
            continue
        data = json.loads(path.read_text())
        if lack := missing_keys(stage, data):
            problems[stage] = f"{file} lacks {lack}"
        if stage in ("eager", "compiled") and "results" in data:
            stages[stage] = _bench_line(data)
        elif file.startswith("train-"):
            stages[stage] = {"tokens_per_s": data.get("tokens_per_s"), "mfu": data.get("mfu"),
                             "peak_mem_gib": data.get("max_memory_gib"),
                             "status": (data.get("summary") or {}).get("status"), "rc": data.get("rc"),
                             "val_loss": (data.get("summary") or {}).get("final_val_loss")}  # fp8: loss at equal steps
            if data.get("rc") != 0:
                problems.setdefault(stage, f"train.py exit {data.get('rc')}")
        elif stage in ROW_KEYS:
            stages[stage] = {"rows": data.get("rows", [])}
    checks = []
    if c := stages.get("compiled"):
        checks += [{"target": f"MFU >= {TARGETS['mfu_compiled']:.0%} (bf16, compiled, of the spec peak)",
                    "value": c["mfu"], "met": c["mfu"] is not None and c["mfu"] >= TARGETS["mfu_compiled"]},
                   {"target": f"compiled train step >= {TARGETS['vs_hf_compiled']}x HF's compiled GPT-2",
                    "value": c["vs_hf"], "met": c["vs_hf"] is not None and c["vs_hf"] >= TARGETS["vs_hf_compiled"]}]
    for row in (stages.get("attention") or {}).get("rows", []):
        if row["kind"] in ("window", "docs") and row.get("vs_full_per_flop") is not None:
            checks.append({"target": f"{row['kind']} at T={row['T']} <= {TARGETS['masked_vs_full_per_flop']}x full "
                                     "causal per FLOP", "value": row["vs_full_per_flop"],
                           "met": row["vs_full_per_flop"] <= TARGETS["masked_vs_full_per_flop"]})
    for row in (stages.get("moe") or {}).get("rows", []):
        if row["name"].startswith("moe"):
            checks.append({"target": f"{row['name']} step <= {TARGETS['moe_vs_dense']}x dense", "met":
                           row["step_vs_dense"] <= TARGETS["moe_vs_dense"], "value": row["step_vs_dense"]})
    for row in (stages.get("mixers") or {}).get("rows", []):
        if row["kind"] == "gdn" and row["backend"] != "torch" and row.get("vs_attention") is not None:
            long = row["T"] >= 8192  # the kernel faster than full attention from 8k on, within 2x of it at 2k
            limit = TARGETS["gdn_kernel_long" if long else "gdn_kernel_short"]
            checks.append({"target": f"gdn on {row['backend']} at T={row['T']} {'<' if long else '<='} {limit}x full "
                                     f"attention's step", "value": row["vs_attention"],
                           "met": row["vs_attention"] < limit if long else row["vs_attention"] <= limit})
    if (train := stages.get("train-compiled")) and (bare := stages.get("compiled")) and bare["tokens_per_s"]:
        ratio = (train["tokens_per_s"] or 0) / bare["tokens_per_s"]
        checks.append({"target": f"train.py compiled >= {TARGETS['train_vs_bare']}x the bare compiled step's tok/s",
                       "value": ratio, "met": ratio >= TARGETS["train_vs_bare"]})
    if (fp8 := stages.get("fp8")) and (train := stages.get("train-compiled")) and train["tokens_per_s"]:
        stages["fp8"]["speedup_vs_bf16"] = (fp8["tokens_per_s"] or 0) / train["tokens_per_s"]
        stages["fp8"]["val_loss_bf16"] = train.get("val_loss")  # the same steps: FP8's loss beside bf16's
    return {"date": datetime.datetime.now().isoformat(timespec="seconds"), "out_dir": str(out_dir),
            "stages": stages, "targets": checks, "problems": problems, "missing": missing}


def render(summary: dict[str, Any]) -> str:
    def fmt(value: Any, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [f"{'stage':<16}{'tok/s':>12}{'MFU':>8}{'peak GiB':>10}  breakdown of the step (ms)"]
    for stage, s in summary["stages"].items():
        if "rows" in s:
            continue
        parts = ", ".join(f"{k} {v:.1f}" for k, v in s.get("breakdown_ms", {}).items())
        lines.append(f"{stage:<16}{fmt(s['tokens_per_s'], ',.0f'):>12}{fmt(s['mfu'], '.1%'):>8}"
                     f"{fmt(s['peak_mem_gib'], '.2f'):>10}  {parts}")
    lines += [f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {fmt(t['value'], '.3f')}"
              for t in summary["targets"]]
    lines += [f"  problem: {stage}: {why}" for stage, why in summary["problems"].items()]
    if summary["missing"]:
        lines.append(f"  not run: {' '.join(summary['missing'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m lmlab.bench env|summary", description=__doc__.split("\n\n")[0])
    p.add_argument("command", choices=["env", "summary"])
    p.add_argument("out", type=Path, nargs="?", default=None, help="summary: the output folder of bench_gpu.sh")
    p.add_argument("--dry-run", action="store_true", help="env: record the CPU dry run (the device is the CPU)")
    p.add_argument("--json", type=Path, default=None, help="env: write the record here")
    args = p.parse_args(argv)
    if args.command == "env":
        out = env_info(args.dry_run)
        print(" | ".join(f"{k} {v}" for k, v in out.items() if k not in ("date",)), flush=True)
        write_json(args.json, out)
        return out
    if args.out is None:
        p.error("summary needs the output folder")
    out = summarize(args.out)
    print(render(out), flush=True)
    write_json(args.out / "summary.json", out)
    if out["problems"]:
        sys.exit(1)
    return out


if __name__ == "__main__":
    main()
