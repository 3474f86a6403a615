"""python -m lmlab.bench moe: ffn=moe against the dense FFN at equal active FLOPs, in time, memory and router share.

    python -m lmlab.bench moe --experts 8 64 --json docs/cpu/moe.json

Contestants, all the default recipe at the `--set` sizes, trained through LitGPT's loss and optimizer (the bench's
Contestant step: forward, loss, backward, clipping, AdamW): the dense FFN (ffn=swiglu); for each E in `--experts`,
an MoE whose top_k=1 expert is the dense FFN (each expert SwiGLU of the dense hidden size: the active FLOPs of the
dense model plus a router), and a fine-grained one with top_k=2 experts of half that size (the same active FLOPs).
Blocks of steps are timed interleaved (order alternating per repeat); reported: tokens/s of a train step (median of
repeats), the ratio of the MoE's step time to the dense one's in the same repeats (and of forward + backward alone:
AdamW's step runs over every expert's weights, so it grows with the total, not the active, parameters), the peak
memory of a step (lmlab.bench.timing.peak_step_bytes) and the router's share of the step: the routers' own forward
and backward (matmul, scores, top-k, the sort by expert, the balancing losses) on the layers' real inputs, over the
step. `--device cuda --precision bf16` runs it on a GPU under bf16 autocast (as bf16-mixed trains).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from lmlab.bench.report import write_json
from lmlab.model.moe import expert_counts


def _contestant(name: str, overrides: list[str], device: torch.device, bf16: bool) -> Any:
    from lmlab import compose
    from lmlab.bench.timing import Contestant
    from lmlab.config import arch_config
    from lmlab.run.lit import LitGPT
    from lmlab.model.gpt import validate

    cfg = compose(overrides)
    gcfg = validate(arch_config(cfg, vocab_size=cfg.model.vocab_size or 256))
    torch.manual_seed(0)
    lit = LitGPT(model=gcfg.to_dict(), optim=dict(cfg.optim), schedule=dict(cfg.schedule), max_steps=10_000,
                 divergence={"spike_factor": 0}).to(device)
    lit.model.train()

    def loss(batch):
        x, y = batch
        parts = lit.model(x, y, parts=True)
        return parts[0]  # the objective: with an MoE's balancing loss, as training runs it

    from contextlib import nullcontext

    def autocast():
        return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    return Contestant(name, lit.model, loss, lit.configure_optimizers(), dict(cfg.optim).get("grad_clip", 0.0),
                      autocast)


def router_seconds(model: Any, batch: tuple[torch.Tensor, torch.Tensor], repeats: int = 5,
                   sync: Any = lambda: None) -> float:
    """Seconds of all the routers' forward + backward in one train step: each MoE layer's input captured on a
    forward, then its routing alone (logits, scores, top-k, the sort by expert, the balancing losses) timed."""
    from lmlab.model.moe import balance_loss, route

    inputs: dict[int, torch.Tensor] = {}
    moes = [b.mlp for b in model.h if hasattr(b.mlp, "router")]
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach()))
             for i, m in enumerate(moes)]
    with torch.no_grad():
        model(batch[0])
    for h in hooks:
        h.remove()
    best = float("inf")
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        for i, m in enumerate(moes):
            x = inputs[i].reshape(-1, inputs[i].size(-1))
            w = m.router.weight.detach().requires_grad_()
            logits = F.linear(x, w)
            idx, weights, p = route(logits, m.top_k, m.score, m.norm_topk)
            chosen = idx.reshape(-1)
            counts = expert_counts(chosen, m.n_experts)
            torch.argsort(chosen, stable=True)
            total = weights.sum() + balance_loss(counts.float(), p.sum(0), x.size(0), m.top_k)
            (total + torch.logsumexp(logits, -1).square().mean()).backward()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lmlab.bench.timing import peak_step_bytes, timed

    p = argparse.ArgumentParser(prog="python -m lmlab.bench moe", description=__doc__.split("\n\n")[0])
    p.add_argument("--experts", nargs="+", type=int, default=[8, 64], help="n_experts of the MoE contestants")
    p.add_argument("--set", nargs="*", default=["model.n_layer=4", "model.d_model=128", "model.n_head=4",
                                                "model.max_seq_len=128"], help="compose overrides (sizes)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=3, help="train steps per timed block")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16 = autocast, as bf16-mixed")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    bf16 = args.precision == "bf16"
    base = ["ffn=swiglu", *args.set, "logger=none"]
    cases = {"dense swiglu": base}
    for E in args.experts:
        moe = ["ffn=moe", "ffn.expert=swiglu", f"ffn.n_experts={E}", "ffn.balance_loss=0.01", *args.set]
        cases[f"moe E={E} k=1 (dense-size experts)"] = [*moe, "ffn.top_k=1"]
        cases[f"moe E={E} k=2 (half-size experts)"] = [*moe, "ffn.top_k=2", "ffn.hidden_mult=2"]
    contestants = [_contestant(name, overrides, device, bf16) for name, overrides in cases.items()]
    V, T = contestants[0].model.cfg.vocab_size, contestants[0].model.cfg.max_seq_len
    batches = [tuple(torch.randint(0, V, (args.batch, T), device=device) for _ in range(2)) for _ in range(4)]
    block = [batches[i % len(batches)] for i in range(args.steps)]
    for c in contestants:  # warm-up, then the peak memory of one step
        c.train_step(batches[0])
        c.peak_bytes = peak_step_bytes(c, batches[0])
    fb: dict[str, list[float]] = {c.name: [] for c in contestants}  # forward + backward only, no optimizer step

    def fwd_bwd(c):
        def step(batch):
            with c.autocast():
                loss = c.loss(batch)
            loss.backward()
            c.optimizer.zero_grad(set_to_none=True)
        return step

    for r in range(args.repeats):
        for c in contestants if r % 2 == 0 else contestants[::-1]:
            c.train_s.append(timed(c.train_step, block, sync))
            fb[c.name].append(timed(fwd_bwd(c), block, sync))
    dense = contestants[0]
    rows = []
    for c in contestants:
        step = statistics.median(c.train_s)
        with c.autocast():
            router = router_seconds(c.model, batches[0], sync=sync) if c is not dense else 0.0
        rows.append({"name": c.name, "params": c.model.num_params(), "active_params": c.model.num_params(active=True),
                     "train_tok_s": args.batch * T / step, "step_s": step,
                     "step_vs_dense": statistics.median(a / b for a, b in zip(c.train_s, dense.train_s)),
                     "fwd_bwd_vs_dense": statistics.median(a / b for a, b in zip(fb[c.name], fb[dense.name])),
                     "peak_mem_mb": c.peak_bytes / 2**20, "router_share": router / step})
        row = rows[-1]
        print(f"{c.name:<34} {row['params'] / 1e6:>6.2f}M ({row['active_params'] / 1e6:.2f}M active)  "
              f"{row['train_tok_s']:>8,.0f} tok/s  x{row['step_vs_dense']:.2f} dense "
              f"(fwd+bwd x{row['fwd_bwd_vs_dense']:.2f})  "
              f"peak {row['peak_mem_mb']:>7,.0f} MB  router {100 * row['router_share']:.1f}%", flush=True)
    out = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "threads": args.threads,
           "device": device.type, "precision": args.precision,
           "batch": args.batch, "seq_len": T, "overrides": args.set, "repeats": args.repeats, "rows": rows}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
