"""python -m lmlab.bench attention: the masked attention paths against full causal attention, in time and memory.

    python -m lmlab.bench attention --lengths 1024 4096 --window 256 --json docs/cpu/attention.json

Each case is one attention layer (d_model 256, 4 heads, batch 1) trained for a few forward + backward steps in a
fresh process: full causal attention (SDPA's causal kernel), a sliding window of `--window` keys (on the CPU lmlab's
banded path: SDPA block by block, never a (T, T) matrix; on a GPU FlexAttention), documents of ~T/8 tokens masked
(`doc_mask`: a (T, T) boolean mask on the CPU, FlexAttention's block mask on a GPU) and MLA (full causal). Reported:
tokens/s of forward + backward, and the peak memory the process grew by over the weights and the input (the RSS
sampled every millisecond from /proc on the CPU, the allocator's peak on a GPU): the attention's working memory,
forward and backward. `--device cuda` runs in bf16. For the target "masked attention within 1.2x of full causal at
equal FLOPs" each case also reports its train FLOPs (6 x the projections' weights per token plus 6 x attn_width per
(query, key) pair it attends: T(T+1)/2 causal pairs, fewer in a window or within documents) and `vs_full_per_flop`:
its seconds per FLOP over full causal attention's at the same T (1: as fast per FLOP).

Then the KV cache each attention option keeps, measured: one layer of each at the same width (d_model 256, 4 heads of
64) reads 256 tokens into a KVCache, whose tensors' bytes per token (fp32; half that in bf16) are reported beside
what the record's `cache_width` says: MHA, GQA (2 and 1 key/value heads) and MLA (its default latent of 4 x 64 with a
RoPE part of 32, and a smaller latent).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lmlab.bench.report import write_json

_CASE = r"""
import json, sys, threading, time, torch
from lmlab.config import GPTConfig
from lmlab.model.attention import ATTENTIONS
from lmlab.model.mask import documents
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.registry import build
T, kind, window, steps, device = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
torch.set_num_threads(1)
spec = {"full": {"name": "mha"}, "window": {"name": "mha", "window": window},
        "docs": {"name": "mha", "doc_mask": True}, "mla": {"name": "mla"}}[kind]
cfg = resolve(GPTConfig(vocab_size=16, n_layer=1, d_model=256, n_head=4, max_seq_len=T, attention=spec, eod_id=0))
attn = build("attention", ATTENTIONS, cfg.attention, cfg).to(device)
pos = POSITIONS["rope"](256, cfg.attn_head_dim, 4, T, T, {"name": "none"}).to(device)
dtype = torch.bfloat16 if device == "cuda" else torch.float32
x = torch.randn(1, T, 256, device=device, dtype=dtype, requires_grad=True)
attn = attn.to(dtype)
# documents of 1..T/4 tokens (mean T/8): an end-of-document token at random places
tokens = torch.where(torch.rand(1, T, generator=torch.Generator().manual_seed(0)) < 8 / T, 0, 1).to(device)
doc = documents(tokens, 0) if kind == "docs" else None
def rss():
    if device == "cuda":
        return torch.cuda.max_memory_allocated()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096
peak, done = [0], threading.Event()
def sample():
    while not done.is_set():
        peak[0] = max(peak[0], rss())
        time.sleep(0.001)
def step():
    attn(x, pos, doc=doc).float().sum().backward()
    if device == "cuda":
        torch.cuda.synchronize()
step()  # warm-up (a compiled kernel: its compilation)
if device == "cuda":
    torch.cuda.reset_peak_memory_stats()
base = torch.cuda.memory_allocated() if device == "cuda" else rss()  # the weights and the input, before a step
threading.Thread(target=sample, daemon=True).start()
start = time.perf_counter()
for _ in range(steps):
    step()
seconds = time.perf_counter() - start
done.set()
peak[0] = max(peak[0], rss())
# the (query, key) pairs attended: causal, within the window, within each query's document
i = torch.arange(T)
pairs = int((i + 1).clamp(max=window).sum()) if kind == "window" else T * (T + 1) // 2
if doc is not None:
    sizes = torch.bincount(doc[0].cpu())
    pairs = int((sizes * (sizes + 1) // 2).sum())
weights = sum(m.weight.numel() for m in attn.modules() if isinstance(m, torch.nn.Linear))
flops = 6 * weights * T + 6 * pairs * cfg.attn_width
print(json.dumps({"tokens_per_s": steps * T / seconds, "step_s": seconds / steps,
                  "peak_growth_mb": (peak[0] - base) / 2**20, "pairs": pairs, "train_flops": flops,
                  "tflops_per_s": flops / (seconds / steps) / 1e12}))
"""

KINDS = ("full", "window", "docs", "mla")


def run_case(T: int, kind: str, window: int, steps: int, device: str = "cpu") -> dict[str, Any]:
    """One case in a fresh process (its own peak memory), one thread."""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", _CASE, str(T), kind, str(window), str(steps), device], env=env,
                         capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise RuntimeError(f"attention bench case T={T} {kind} failed: {res.stderr[-2000:]}")
    return {"T": T, "kind": kind, "window": window if kind == "window" else None, "device": device,
            **json.loads(res.stdout.strip().splitlines()[-1])}


CACHE_CASES = {"mha": {"name": "mha"}, "gqa (2 kv heads)": {"name": "gqa"}, "mqa": {"name": "mqa"},
               "mla (default)": {"name": "mla"}, "mla (kv_lora_rank 64)": {"name": "mla", "kv_lora_rank": 64}}


def cache_rows(tokens: int = 256) -> list[dict[str, Any]]:
    """Each option's KV cache after reading `tokens` tokens, in bytes per token and layer (fp32)."""
    import torch

    from lmlab.config import GPTConfig
    from lmlab.model.attention.cache import KVCache
    from lmlab.model.gpt import GPT, validate

    rows = []
    for name, attention in CACHE_CASES.items():
        cfg = validate(GPTConfig(vocab_size=16, n_layer=1, d_model=256, n_head=4, n_kv_head=2, max_seq_len=tokens,
                                 attention=attention))
        cache = KVCache(1)
        with torch.no_grad():
            GPT(cfg).eval()(torch.zeros(1, tokens, dtype=torch.long), cache=cache)
        held = sum(t.numel() * t.element_size() for t in (cache.layers[0].k, cache.layers[0].v))
        rows.append({"attention": name, "bytes_per_token": held / tokens, "cache_width": cfg.cache_width})
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m lmlab.bench attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096], help="sequence lengths T")
    p.add_argument("--window", type=int, default=256, help="the sliding window's keys W")
    p.add_argument("--steps", type=int, default=3, help="timed forward + backward steps per case")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS),
                   help="full causal (SDPA), a sliding window, document masks (documents of ~T/8), MLA (full causal)")
    p.add_argument("--device", default="cpu", help="cpu, or cuda: bf16, FlexAttention for the masked paths")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    rows = []
    for T in args.lengths:
        for kind in args.kinds:
            row = run_case(T, kind, args.window, args.steps, args.device)
            rows.append(row)
            name = f"window {args.window}" if kind == "window" else {"full": "full causal", "docs": "documents",
                                                                     "mla": "mla"}[kind]
            print(f"T={T:>6}  {name:<12} {row['tokens_per_s']:>10,.0f} tok/s  {row['step_s'] * 1e3:>8.1f} ms/step  "
                  f"{row['tflops_per_s']:>8.3f} TFLOP/s  peak +{row['peak_growth_mb']:,.0f} MB", flush=True)
    for row in rows:  # seconds per FLOP against full causal attention at the same length (the target's measure)
        full = next((r for r in rows if r["T"] == row["T"] and r["kind"] == "full"), None)
        row["vs_full_per_flop"] = (row["step_s"] / row["train_flops"]) / (full["step_s"] / full["train_flops"]) \
            if full else None
    cache = cache_rows()
    print("KV cache per token and layer (d_model 256, 4 heads of 64; fp32, measured):")
    for row in cache:
        print(f"  {row['attention']:<22} {row['bytes_per_token']:>6,.0f} B  ({row['cache_width']} numbers)")
    out = {"date": time.strftime("%Y-%m-%d"), "rows": rows, "kv_cache": cache}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
