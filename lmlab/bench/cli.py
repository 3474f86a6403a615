"""python -m lmlab.bench: build the contestants, time them in interleaved repeats, report."""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import platform
import statistics
import time
import warnings
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmlab.bench.breakdown import step_breakdown
from lmlab.bench.loop import lightning_loop_cost
from lmlab.bench.peers import CONFIGS, describe, hf_peer
from lmlab.bench.report import check_targets, render
from lmlab.bench.timing import Contestant, matmul_gflops, peak_step_bytes, spread, timed
from lmlab.model.flops import FLOPS_FORMULA, flops_per_token, matmul_params


def contestants_for(args: argparse.Namespace, cfg, gcfg, peer_kind: str, device: torch.device
                    ) -> tuple[list[Contestant], Any]:
    """lmlab (through LitGPT), the HF peer, and with bf16 lmlab in fp32 as well; and the LitGPT for the loop."""
    from lmlab.run.lit import LitGPT, configure_optimization

    optim, schedule = (dict(cfg[k]) for k in ("optim", "schedule"))
    horizon = 10_000  # the LR schedule's length: its values don't change the speed of a step
    bf16 = args.precision == "bf16"

    def autocast():  # what Lightning's bf16-mixed does around forward and loss
        return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    def lmlab_contestant(name: str, mixed: bool) -> tuple[Contestant, Any]:
        lit = LitGPT(model=gcfg.to_dict(), optim=optim, schedule=schedule, max_steps=horizon,
                     compile=args.compile, divergence={"spike_factor": 0}).to(device)
        return Contestant(name, lit.model, lit.loss, lit.configure_optimizers(), optim.get("grad_clip", 0.0),
                          autocast if mixed else nullcontext), lit

    ours, lit = lmlab_contestant("lmlab", bf16)
    peer = hf_peer(peer_kind, gcfg).to(device)
    peer_fwd = torch.compile(peer) if args.compile else peer

    def peer_loss(batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # LitGPT.loss, on the peer's logits
        x, y = batch
        return F.cross_entropy(peer_fwd(input_ids=x).logits.flatten(0, 1).float(), y.flatten())

    peer.get_output_embeddings().is_readout = True  # its head is a readout, as lmlab's (AdamW under optim=muon)
    peer_optimizer = configure_optimization(peer, optim, schedule, horizon)  # what LitGPT builds, for the peer
    contestants = [ours, Contestant(f"hf {type(peer).__name__}", peer, peer_loss, peer_optimizer,
                                    optim.get("grad_clip", 0.0), autocast)]
    if bf16 and args.fp32_baseline:  # bf16's target is a speed-up over lmlab's own fp32 step, in the same repeats
        contestants.append(lmlab_contestant("lmlab fp32", False)[0])
    return contestants, lit


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lmlab import compose, env
    from lmlab.config import arch_config
    from lmlab.model.gpt import validate

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    peer_kind, overrides = CONFIGS[args.config]
    cfg = compose(overrides + list(args.set or []) + ([f"malloc={args.malloc}"] if args.malloc else []))
    env.setup(cfg)  # offline, cfg.threads and cfg.malloc, as train.py
    if args.threads:  # after setup_env: the command line wins over the config's `threads`
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*(no `val_dataloader`|smaller than the logging interval).*")
    import lightning.pytorch  # noqa: F401  (its import sets its logger to INFO: quiet it after)

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the per-fit GPU/TPU banner and tips
    gcfg = validate(arch_config(cfg, vocab_size=cfg.model.vocab_size))
    torch.manual_seed(0)
    contestants, lit = contestants_for(args, cfg, gcfg, peer_kind, device)
    ours, peer = contestants[:2]

    B, T, V = args.batch, gcfg.max_seq_len, gcfg.vocab_size
    batches = [(torch.randint(0, V, (B, T), device=device), torch.randint(0, V, (B, T), device=device))
               for _ in range(max(8, args.loop_steps + 1))]
    first_s = {}  # the warm-up's seconds: with --compile, mostly compilation
    for c in contestants:
        t0 = time.perf_counter()
        for i in range(args.warmup):
            c.train_step(batches[i % len(batches)])
            c.eval_step(batches[i % len(batches)])
        sync()
        first_s[c.name] = time.perf_counter() - t0
        if not args.no_memory:
            c.peak_bytes = peak_step_bytes(c, batches[0])

    # Blocks of about --block-s seconds (as many steps as that takes lmlab), so that short steps still make blocks
    # long enough to time; every model runs the same steps.
    steps = args.steps or max(1, min(200, round(args.block_s / timed(ours.train_step, batches[:1], sync))))
    eval_steps = args.eval_steps or max(1, min(500, round(args.block_s / timed(ours.eval_step, batches[:1], sync))))
    train_block = [batches[i % len(batches)] for i in range(steps)]
    eval_block = [batches[i % len(batches)] for i in range(eval_steps)]

    n_matmul = matmul_params(ours.model)
    flops = flops_per_token(ours.model, T)  # per token, as training's perf/mfu counts them
    mm_dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    mm_n = args.mm_size or (8192 if device.type == "cuda" else 2048)
    ceilings: list[float] = []
    mfu: dict[str, list[float]] = {f"{c.name}/{k}": [] for c in contestants for k in flops}
    for r in range(args.repeats):
        ceilings.append(matmul_gflops(mm_n, mm_dtype, device, sync))
        order = contestants if r % 2 == 0 else contestants[::-1]
        for c in order:
            c.train_s.append(timed(c.train_step, train_block, sync))
        for c in order:
            c.eval_s.append(timed(c.eval_step, eval_block, sync))
        for c in contestants:
            for kind, s in (("train", c.train_s[-1]), ("eval", c.eval_s[-1])):
                mfu[f"{c.name}/{kind}"].append(flops[kind] * B * T / s / 1e9 / ceilings[-1])

    results = {c.name: {
        "params": sum(p.numel() for p in {id(p): p for p in c.model.parameters()}.values()),
        "train_step_s": statistics.median(c.train_s), "eval_step_s": statistics.median(c.eval_s),
        "train_tok_s": B * T / statistics.median(c.train_s), "eval_tok_s": B * T / statistics.median(c.eval_s),
        "train_mfu": statistics.median(mfu[f"{c.name}/train"]), "eval_mfu": statistics.median(mfu[f"{c.name}/eval"]),
        "peak_mem_mb": None if args.no_memory else c.peak_bytes / 2 ** 20, "warmup_s": first_s[c.name],
        "optim_state_bytes": c.optimizer_state_bytes()}  # after the timed steps: the state exists
        for c in contestants}
    ratios = {f"train_vs_{peer_kind}": spread([h / o for o, h in zip(ours.train_s, peer.train_s)]),
              f"eval_vs_{peer_kind}": spread([h / o for o, h in zip(ours.eval_s, peer.eval_s)])}
    if not args.no_memory:
        ratios[f"mem_vs_{peer_kind}"] = ours.peak_bytes / peer.peak_bytes
    if len(contestants) == 3:
        ratios["bf16_vs_fp32"] = spread([f / o for o, f in zip(ours.train_s, contestants[2].train_s)])
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "device": device.type,
           "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
           "precision": args.precision, "compile": args.compile, "malloc": cfg.malloc, "config": args.config,
           "overrides": overrides + list(args.set or []), "arch": describe(gcfg), "batch": B, "seq_len": T, "vocab": V,
           "repeats": args.repeats, "steps_per_block": steps, "eval_steps_per_block": eval_steps,
           "flops_formula": FLOPS_FORMULA, "matmul_params": n_matmul, "flops_per_token": flops,
           "ceiling": {"op": f"torch.mm {mm_n}^3 {mm_dtype}", "gflops": spread(ceilings)},
           "results": results, "ratios": ratios}
    if args.breakdown:
        try:  # a profiler that cannot start (e.g. no CUPTI) must not cost the timings above
            ceiling = statistics.median(ceilings)  # in the run's precision: no yardstick for bf16's fp32 baseline
            out["breakdown"] = {c.name: step_breakdown(c, batches[0], results[c.name]["train_step_s"],
                                                       6 * n_matmul * B * T, ceiling if c in (ours, peer) else None,
                                                       sync)
                                for c in contestants}
        except Exception as exc:  # noqa: BLE001  (reported in the output instead)
            out["breakdown_error"] = f"{type(exc).__name__}: {exc}"
    if args.peak_tflops:
        out["mfu_vs_spec_peak"] = {c.name: flops["train"] * B * T / statistics.median(c.train_s) / 1e12
                                   / args.peak_tflops for c in contestants}
    if args.loop_repeats:
        precision = "bf16-mixed" if args.precision == "bf16" else "32-true"
        out["lightning_loop"] = lightning_loop_cost(cfg, lit, batches[:args.loop_steps + 1], precision, device,
                                                    sync, args.loop_repeats)
    out["targets"] = check_targets(out)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m lmlab.bench", description="lmlab's training step against Hugging Face "
                                "transformers, side by side in one process")
    p.add_argument("--config", choices=sorted(CONFIGS), default="llama", help="architecture and size preset")
    p.add_argument("--set", nargs="*", metavar="KEY=VALUE", help="more compose overrides, e.g. model.n_layer=4")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: the config's)")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16 = autocast, as bf16-mixed")
    p.add_argument("--compile", action="store_true", help="torch.compile both models")
    p.add_argument("--fp32-baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="with --precision bf16, also time lmlab in fp32 (the bf16 speed-up target)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=7, help="interleaved repeats (>= 7 for the issue's numbers)")
    p.add_argument("--block-s", type=float, default=2.0, help="seconds per timed block (sets the steps per block)")
    p.add_argument("--steps", type=int, default=None, help="train steps per timed block (default: from --block-s)")
    p.add_argument("--eval-steps", type=int, default=None, help="eval forwards per block (default: from --block-s)")
    p.add_argument("--warmup", type=int, default=2, help="untimed train + eval steps per model first")
    p.add_argument("--loop-steps", type=int, default=10, help="timed steps per Lightning fit (a monitor cycle)")
    p.add_argument("--loop-repeats", type=int, default=3, help="Lightning-vs-bare repeats (0: skip)")
    p.add_argument("--mm-size", type=int, default=None, help="ceiling matmul size (default 2048 CPU, 8192 GPU)")
    p.add_argument("--peak-tflops", type=float, default=None, help="also report MFU against this spec peak")
    p.add_argument("--malloc", choices=["system", "keep"], default=None,
                   help="glibc's freed-memory policy for both models (default: the config's malloc, keep)")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    p.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                   help="profile one train step per model: time in matmuls / attention / optimizer / other")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    out = run(args)
    print(render(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
