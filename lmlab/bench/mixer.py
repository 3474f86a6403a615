"""python -m lmlab.bench mixer: the recurrent mixers' chunked training form against full causal attention, and their
generation state against the KV cache.

    python -m lmlab.bench mixer --lengths 1024 4096 --json docs/cpu/mixer.json

Training: one layer of each (d_model 256, 4 heads, batch 1) runs a few forward + backward steps in a fresh process
(its own peak memory): full causal attention (SDPA's causal kernel) and each recurrent mixer of the registry in its
chunked form (lmlab.model.mixer). Reported: tokens/s, the peak memory the process grew by over the weights and the
input (the RSS sampled every millisecond), the step's FLOPs (6 × the projections' weights per token, plus 3 × the
forward's own: attention's 2·attn_width per (query, key) pair, a mixer's geometry `flops_per_token`), and
`vs_matmul_bound`: the step's seconds over what its FLOPs would take at the machine's matmul rate (a 512³ torch.mm
measured in the same process; 1: as fast as a plain matmul). Targets: a mixer's chunked form within 2× of its bound,
and faster than full attention at T = 4096.

Generation: a 2-layer model of each mixer (and of attention) reads a `--prompt`-token prompt into its cache, then
generates `--new` tokens one at a time: tokens/s of those steps, and the bytes its cache holds per layer after the
prompt and after the new tokens (a KV cache grows with the text; a recurrent state does not).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from lmlab.bench.report import write_json

D_MODEL, HEADS = 256, 4


def _spec(kind: str, backend: str = "torch") -> dict[str, Any]:
    return {"name": "attention"} if kind == "attention" else {"name": kind, "backend": backend}


def _peak_rss() -> tuple[list[int], threading.Event]:
    """A thread sampling this process's RSS every millisecond into peak[0] until `done` is set."""
    peak, done = [0], threading.Event()

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    peak[0] = rss()
    threading.Thread(target=sample, daemon=True).start()
    return peak, done


def case(T: int, kind: str, steps: int, device: str = "cpu", backend: str = "torch") -> dict[str, Any]:
    """One layer's forward + backward at length T, in this process (run by `run_case` in a fresh one): on the CPU in
    float32 (peak memory: the RSS), on CUDA under bf16 autocast as bf16-mixed trains (peak: CUDA's allocator); a
    mixer on `backend` (mixer.backend: torch, auto, fla, ...), its path as it ran recorded."""
    import contextlib

    import torch

    from lmlab.bench.timing import matmul_gflops
    from lmlab.config import GPTConfig
    from lmlab.model.attention import ATTENTIONS
    from lmlab.model.mixer import MIXERS
    from lmlab.model.position import POSITIONS
    from lmlab.model.resolve import resolve
    from lmlab.registry import build, option_params

    torch.set_num_threads(1)
    cfg = resolve(GPTConfig(vocab_size=16, n_layer=1, d_model=D_MODEL, n_head=HEADS, max_seq_len=T,
                            mixer=_spec(kind, backend)))
    if kind == "attention":
        layer = build("attention", ATTENTIONS, cfg.attention, cfg)
        forward_extra = T * (T + 1) // 2 * 2 * cfg.attn_width  # the scores and the weighted sum, causal pairs
    else:
        layer = build("mixer", MIXERS, cfg.mixer, cfg)
        name, params = option_params("mixer", MIXERS, cfg.mixer)
        geometry = MIXERS[name].geometry(cfg, **{k: v for k, v in params.items() if k != "pattern"})
        forward_extra = geometry.flops_per_token * T
    cuda = device == "cuda"
    dev = torch.device(device)
    pos = POSITIONS["rope"](D_MODEL, cfg.attn_head_dim, HEADS, T, T, {"name": "none"}).to(dev)
    layer = layer.to(dev)
    x = torch.randn(1, T, D_MODEL, requires_grad=True, device=dev)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext

    def step() -> None:
        with autocast():
            y = layer(x, pos)
        y.float().sum().backward()

    step()  # warm-up (a kernel's autotuning, the first allocations)
    ceiling = matmul_gflops(4096 if cuda else 512, torch.bfloat16 if cuda else torch.float32, dev, sync=sync) * 1e9
    if cuda:
        sync()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        peak, done = _peak_rss()
        base = peak[0]
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    seconds = (time.perf_counter() - start) / steps
    if cuda:
        growth = torch.cuda.max_memory_allocated() - base
    else:
        done.set()
        growth = peak[0] - base
    weights = sum(m.weight.numel() for m in layer.modules() if isinstance(m, torch.nn.Linear))
    flops = 6 * weights * T + 3 * forward_extra
    return {"tokens_per_s": T / seconds, "step_s": seconds, "peak_growth_mb": growth / 2**20,
            "train_flops": flops, "gflops_per_s": flops / seconds / 1e9, "matmul_gflops": ceiling / 1e9,
            "vs_matmul_bound": seconds / (flops / ceiling), "device": device,
            "backend": "sdpa" if kind == "attention" else getattr(layer, "backend_used", None) or "torch"}


def run_case(T: int, kind: str, steps: int, device: str = "cpu", backend: str = "torch") -> dict[str, Any]:
    """`case` in a fresh process (its own peak memory), one thread."""
    code = (f"import json; from lmlab.bench.mixer import case; "
            f"print(json.dumps(case({T}, {kind!r}, {steps}, {device!r}, {backend!r})))")
    res = subprocess.run([sys.executable, "-c", code], env={**os.environ, "OMP_NUM_THREADS": "1"},
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"mixer bench case T={T} {kind} ({backend}) failed: {res.stderr[-2000:]}")
    return {"T": T, "kind": kind, "requested": backend, **json.loads(res.stdout.strip().splitlines()[-1])}


def generation(kind: str, prompt: int, new: int) -> dict[str, Any]:
    """A 2-layer model of `kind` reads `prompt` tokens into its cache, then generates `new` one at a time."""
    import torch

    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import KVCache
    from lmlab.model.gpt import GPT

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=256, n_layer=2, d_model=D_MODEL, n_head=HEADS, max_seq_len=prompt + new,
                          position={"name": "rope"}, mixer=_spec(kind))).eval()
    cache = KVCache(len(model.h))
    with torch.no_grad():
        logits = model(torch.randint(0, 256, (1, prompt)), cache=cache)
        after_prompt = [layer.bytes for layer in cache.layers]
        start = time.perf_counter()
        for _ in range(new):
            logits = model(logits[:, -1:].argmax(-1), cache=cache)
        seconds = time.perf_counter() - start
    return {"kind": kind, "prompt": prompt, "new_tokens": new, "tokens_per_s": new / seconds,
            "cache_bytes_per_layer_after_prompt": after_prompt[0],
            "cache_bytes_per_layer_at_end": cache.layers[0].bytes}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lmlab.model.mixer import MIXERS

    kinds = sorted(MIXERS)  # attention first: the reference
    p = argparse.ArgumentParser(prog="python -m lmlab.bench mixer", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096], help="sequence lengths T")
    p.add_argument("--steps", type=int, default=3, help="timed forward + backward steps per case")
    p.add_argument("--kinds", nargs="+", choices=kinds, default=kinds)
    p.add_argument("--prompt", type=int, default=4096, help="the generation case's prompt")
    p.add_argument("--new", type=int, default=32, help="tokens generated one at a time after it")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: bf16 autocast, as bf16-mixed")
    p.add_argument("--backends", nargs="+", default=["torch"],
                   help="mixer.backend of each mixer case (torch, auto, fla, mamba_ssm): auto takes the kernel where "
                        "it runs; attention runs once, on SDPA")
    p.add_argument("--no-generation", action="store_true", help="the training cases only")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    rows = []
    for T in args.lengths:
        for kind in args.kinds:
            for backend in ["sdpa"] if kind == "attention" else args.backends:
                row = run_case(T, kind, args.steps, args.device, backend)
                rows.append(row)
                print(f"T={T:>6}  {kind:<10} {row['backend']:<9} {row['tokens_per_s']:>9,.0f} tok/s  "
                      f"{row['step_s'] * 1e3:>8.1f} ms/step  {row['vs_matmul_bound']:>5.2f}x its matmul bound  "
                      f"peak +{row['peak_growth_mb']:,.0f} MB", flush=True)
    for row in rows:  # each case against full attention at its length: the measure for the kernels
        full = next((r for r in rows if r["T"] == row["T"] and r["kind"] == "attention"), None)
        row["vs_attention"] = None if full is None else row["step_s"] / full["step_s"]
    gen = []
    for kind in [] if args.no_generation else args.kinds:
        gen.append(g := generation(kind, args.prompt, args.new))
        print(f"generate after {args.prompt} tokens  {kind:<10} {g['tokens_per_s']:>7,.1f} tok/s  cache "
              f"{g['cache_bytes_per_layer_after_prompt'] / 2**10:>8,.0f} KiB/layer -> "
              f"{g['cache_bytes_per_layer_at_end'] / 2**10:,.0f} KiB", flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "device": args.device, "rows": rows, "generation": gen}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
