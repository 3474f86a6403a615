"""python -m lmlab.bench: lmlab's training step against Hugging Face `transformers`, side by side in one process.

    python -m lmlab.bench                          # llama-like vs LlamaForCausalLM, fp32, the config's threads
    python -m lmlab.bench --config gpt2 --threads 1 --json bench.json
    python -m lmlab.bench --precision bf16 --set model.n_layer=4 model.d_model=256

lmlab goes through the real path: `compose(overrides)` -> GPTConfig -> `LitGPT` (whose `loss` and
`configure_optimizers` are what Lightning runs), then the step: forward, cross-entropy on float logits, backward,
grad-norm clipping, AdamW over lmlab's parameter groups, LR schedule. The peer (LlamaForCausalLM for pre/rms/swiglu/
rope, GPT2LMHeadModel for pre/layer/mlp+gelu_tanh/learned) is built at the same sizes, with SDPA attention, and runs
the very same loop. Shared machines are noisy, so only ratios of blocks timed next to each other mean anything:
each repeat times one block per contestant (order alternating, A B then B A), a matmul ceiling, and the ratios of
that repeat; the table gives medians and min-max over repeats. Needs the `bench` extra (transformers).
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SIZES = ["model.n_layer=6", "model.d_model=384", "model.n_head=6", "model.max_seq_len=256", "model.vocab_size=4096",
         "model.tie_embeddings=true", "model.dropout=0.0", "attention=mha", "placement=pre"]
LLAMA = ["norm=rms", "ffn=swiglu", "position=rope", "model.bias=false"]
GPT2 = ["norm=layer", "ffn=mlp", "activation=gelu_tanh", "position=learned", "model.bias=true"]
SMALL = ["model.n_layer=4", "model.d_model=128", "model.n_head=4", "model.max_seq_len=64"]
CONFIGS = {"llama": ("llama", SIZES + LLAMA), "gpt2": ("gpt2", SIZES + GPT2), "small": ("gpt2", SIZES + GPT2 + SMALL)}
# The targets: (ratio key, median at least, every repeat at least); MFU and memory are checked apart.
TARGETS = {"llama": {"train": (1.00, 0.95), "eval": (1.00, 0.95)},
           "gpt2": {"train": (1.10, None), "eval": (1.10, None)},
           "small": {"train": (1.15, None), "eval": (1.15, None)}}
FLOPS_FORMULA = "train 6*N + 12*L*T*d FLOPs/token, eval 2*N + 4*L*T*d (N = matmul weights, tied head once)"


# What each peer can express: overrides that leave these would compare two different architectures.
PEER_ARCH = {"llama": {"placement": "pre", "norm": "rms", "ffn": "swiglu", "position": "rope", "rope_scaling": "none"},
             "gpt2": {"placement": "pre", "norm": "layer", "ffn": "mlp", "activation": "gelu_tanh",
                      "position": "learned"}}


def hf_peer(kind: str, gcfg) -> nn.Module:
    """The transformers model with lmlab's sizes (same FFN width, eps, bias, tying), SDPA attention, no dropout."""
    import transformers

    specs = {**{g: getattr(gcfg, g) for g in PEER_ARCH[kind]}, "ffn": gcfg.ffn_spec}
    if wrong := {g: specs[g]["name"] for g, name in PEER_ARCH[kind].items() if specs[g]["name"] != name}:
        raise ValueError(f"the {kind} peer needs {PEER_ARCH[kind]}; the overrides set {wrong}")
    if any(gcfg.attention.get(k, d) != d for k, d in (("qk_norm", False), ("logn_scaling", False), ("temperature", 1))):
        raise ValueError(f"the {kind} peer has plain attention; drop attention flags {gcfg.attention}")
    common = dict(vocab_size=gcfg.vocab_size, tie_word_embeddings=gcfg.tie_embeddings, use_cache=False)
    if kind == "llama":
        hf = transformers.LlamaConfig(hidden_size=gcfg.d_model, intermediate_size=gcfg.ffn_hidden,
                                      num_hidden_layers=gcfg.n_layer, num_attention_heads=gcfg.n_head,
                                      num_key_value_heads=gcfg.kv_heads, max_position_embeddings=gcfg.max_seq_len,
                                      rms_norm_eps=gcfg.norm.get("eps", 1e-6), attention_bias=gcfg.bias,
                                      mlp_bias=gcfg.bias, rope_parameters={"rope_type": "default",
                                                                           "rope_theta": gcfg.position["theta"]},
                                      **common)
        model = transformers.LlamaForCausalLM._from_config(hf, attn_implementation="sdpa")
    else:
        hf = transformers.GPT2Config(n_embd=gcfg.d_model, n_inner=gcfg.ffn_hidden, n_layer=gcfg.n_layer,
                                     n_head=gcfg.n_head, n_positions=gcfg.max_seq_len, activation_function="gelu_new",
                                     layer_norm_epsilon=gcfg.norm.get("eps", 1e-5), resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, **common)
        model = transformers.GPT2LMHeadModel._from_config(hf, attn_implementation="sdpa")
    return model.train()


def describe(gcfg) -> str:
    ffn = gcfg.ffn_spec["name"] + (f"({gcfg.activation['name']})" if gcfg.ffn_spec["name"] in ("mlp", "glu") else "")
    return (f"{gcfg.placement['name']}/{gcfg.norm['name']}/{ffn}/{gcfg.position['name']}, {gcfg.n_layer} layers x "
            f"d {gcfg.d_model} x {gcfg.n_head} heads ({gcfg.kv_heads} kv), ffn {gcfg.ffn_hidden}, bias "
            f"{str(gcfg.bias).lower()}, tied {str(gcfg.tie_embeddings).lower()}")


def matmul_params(model: nn.Module) -> int:
    """N in 6·N: weights that take part in a matmul (Linear layers, the tied head once); lookups don't count."""
    return sum({id(m.weight): m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear)}.values())


class Contestant:
    """One model and its optimizer, with the train step and eval forward as lmlab's training loop runs them."""

    def __init__(self, name: str, model: nn.Module, loss: Callable, optimizer: dict, grad_clip: float,
                 autocast: Any) -> None:
        self.name, self.model, self.loss, self.grad_clip, self.autocast = name, model, loss, grad_clip, autocast
        self.optimizer, self.scheduler = optimizer["optimizer"], optimizer["lr_scheduler"]["scheduler"]
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.train_s: list[float] = []
        self.eval_s: list[float] = []
        self.peak_bytes = 0

    def train_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        with self.autocast():
            loss = self.loss(batch)
        loss.backward()
        if self.grad_clip:
            torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def eval_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
        self.model.eval()
        with torch.inference_mode(), self.autocast():  # as Lightning validates
            self.loss(batch)
        self.model.train()

    def live_bytes(self) -> int:
        """Bytes the model holds between steps: parameters, buffers and optimizer state, each storage once."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        tensors += [t for s in self.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
        return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def peak_step_bytes(c: Contestant, batch: tuple[torch.Tensor, torch.Tensor]) -> int:
    """Own live bytes + the peak extra bytes allocated during one train step (grads, activations, temporaries).

    GPU: torch.cuda.max_memory_allocated over the step minus what was allocated before it. CPU: torch's CPU
    allocator reports every allocation to the profiler with a running total, so the peak of that total is the CPU
    analogue of max_memory_allocated. Allocator caching and fragmentation (RSS) are not counted on either device.
    """
    device = batch[0].device
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        c.train_step(batch)
        torch.cuda.synchronize()
        return c.live_bytes() + torch.cuda.max_memory_allocated() - before
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    c.train_step(batch)  # the optimizer state exists from here on: count it as live, not as the step's peak
    live = c.live_bytes()
    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        c.train_step(batch)
    peak, stack = 0, list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            peak = max(peak, node.extra_fields.total_allocated)
        stack.extend(node.children)
    return live + peak


@contextmanager
def _quiet_stderr():
    """The profiler's C++ side prints start/stop lines on fd 2 that no setting turns off."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def matmul_gflops(n: int, dtype: torch.dtype, device: torch.device, sync: Callable, tries: int = 3) -> float:
    """The ceiling: the best of `tries` torch.mm (n×n)·(n×n), 2n³ FLOPs each."""
    a, b, c = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(3))
    torch.mm(a, b, out=c)
    best = math.inf
    for _ in range(tries):
        sync()
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)  # into a warm buffer: the compute, not the first touch of fresh pages
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n ** 3 / best / 1e9


def timed(fn: Callable, batches: list, sync: Callable) -> float:
    """Seconds per call over one block."""
    sync()
    t0 = time.perf_counter()
    for batch in batches:
        fn(batch)
    sync()
    return (time.perf_counter() - t0) / len(batches)


def spread(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def lightning_loop_cost(cfg, lit, batches: list, precision: str, device: torch.device, sync: Callable,
                        repeats: int) -> dict[str, Any]:
    """Seconds per step of `trainer.fit` (LitGPT + StabilityMonitor at the configured frequency + metrics.csv
    logger, as train.py sets them up) vs the bare loop, both from a fresh optimizer.

    A fit runs len(batches) steps; the window is steps 1 .. len-1 (one monitor cycle with the default 10, whose
    step 10 is a monitor step; each step from its on_train_batch_start to the next, the last to its
    on_train_batch_end) against the same steps of the bare loop. Step 0 also carries the once-per-run
    init profile and the attention figures (every `attn_every_n_steps`); its extra time over a plain Lightning
    step is reported and amortised over the attention period in `ratio_amortised`, the figure the target reads.
    """
    import lightning.pytorch as L
    from lightning.pytorch.callbacks import Callback
    from omegaconf import OmegaConf

    from lmlab.metrics_csv import MetricsCSV
    from lmlab.monitor import StabilityMonitor

    class StepTimer(Callback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            sync()
            self.marks.append(time.perf_counter())

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            if trainer.global_step >= trainer.max_steps:  # the last step's end, after the monitor's hook; the
                sync()  # fit's teardown (end of epoch, logger finalize) is not a per-step cost
                self.marks.append(time.perf_counter())

    monitor_cfg = OmegaConf.to_container(cfg.monitor, resolve=True)

    def fit() -> list[float]:
        """Seconds of each step: its work, its hooks and logging, and the next batch's fetch."""
        timer = StepTimer()
        with tempfile.TemporaryDirectory() as tmp:
            trainer = L.Trainer(accelerator=device.type, devices=1, precision=precision, max_steps=len(batches),
                                logger=MetricsCSV(tmp), callbacks=[StabilityMonitor(**monitor_cfg), timer],
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp,
                                log_every_n_steps=cfg.trainer.log_every_n_steps)
            trainer.fit(lit, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
        return [b - a for a, b in zip(timer.marks, timer.marks[1:])]

    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if precision == "bf16-mixed" else nullcontext

    def bare() -> float:
        lit.to(device)  # the fit's teardown moved it back to the CPU
        c = Contestant("bare", lit.model, lit.loss, lit.configure_optimizers(), cfg.optim.get("grad_clip", 0.0),
                       autocast)
        c.train_step(batches[0])  # step 0 (optimizer state allocated), outside the window as in the fit
        return timed(c.train_step, batches[1:], sync)

    fit(), bare()  # warm-up: Lightning's first fit imports and sets up more than later ones
    loop, plain, first_extra = [], [], []
    for r in range(repeats):  # A B, then B A: a drift in machine speed hits both sides alike
        each = fit() if r % 2 == 0 else None
        plain.append(bare())
        each = each or fit()
        loop.append(statistics.mean(each[1:]))
        first_extra.append(each[0] - statistics.median(each[1:]))
    ratios = [a / b for a, b in zip(loop, plain)]
    period = monitor_cfg.get("attn_every_n_steps") or len(batches)
    amortised = [r + max(e, 0.0) / period / b for r, e, b in zip(ratios, first_extra, plain)]
    return {"window_steps": len(batches) - 1, "lightning_step_s": statistics.median(loop),
            "bare_step_s": statistics.median(plain), "ratio": spread(ratios),
            "step0_extra_s": statistics.median(first_extra), "ratio_amortised": spread(amortised),
            "lightning_each_step_s": each, "monitor": monitor_cfg}


def contestants_for(args: argparse.Namespace, cfg, gcfg, peer_kind: str, device: torch.device
                    ) -> tuple[list[Contestant], Any]:
    """lmlab (through LitGPT), the HF peer, and with bf16 lmlab in fp32 as well; and the LitGPT for the loop."""
    from lmlab.lit import LitGPT, optimizer_spec
    from lmlab.optim import OPTIMIZERS, SCHEDULES, param_groups
    from lmlab.registry import build, option_params

    optim, schedule = (dict(cfg[k]) for k in ("optim", "schedule"))
    horizon = 10_000  # the LR schedule's length: its values don't change the speed of a step
    bf16 = args.precision == "bf16"

    def autocast():  # what Lightning's bf16-mixed does around forward and loss
        return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()

    def make_optimizer(model: nn.Module) -> dict:  # what LitGPT.configure_optimizers builds, for the peer
        opt = build("optim", OPTIMIZERS, optimizer_spec(optim), param_groups(model, optim.get("weight_decay", 0.0)))
        name, params = option_params("schedule", SCHEDULES, schedule)
        fn = SCHEDULES[name]
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: fn(s, horizon, **params))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched}}

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

    contestants = [ours, Contestant(f"hf {type(peer).__name__}", peer, peer_loss, make_optimizer(peer),
                                    optim.get("grad_clip", 0.0), autocast)]
    if bf16 and args.fp32_baseline:  # bf16's target is a speed-up over lmlab's own fp32 step, in the same repeats
        contestants.append(lmlab_contestant("lmlab fp32", False)[0])
    return contestants, lit


def run(args: argparse.Namespace) -> dict[str, Any]:
    from lmlab import compose
    from lmlab.config import arch_config
    from lmlab.training import setup_env

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    peer_kind, overrides = CONFIGS[args.config]
    cfg = compose(overrides + list(args.set or []) + ([f"malloc={args.malloc}"] if args.malloc else []))
    setup_env(cfg)  # offline, cfg.threads and cfg.malloc, as train.py
    if args.threads:  # after setup_env: the command line wins over the config's `threads`
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", message=".*(no `val_dataloader`|smaller than the logging interval).*")
    import lightning.pytorch  # noqa: F401  (its import sets its logger to INFO: quiet it after)

    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # the per-fit GPU/TPU banner and tips
    gcfg = arch_config(cfg, vocab_size=cfg.model.vocab_size).validate()
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
    attn = gcfg.n_layer * T * gcfg.n_head * gcfg.head_dim
    flops = {"train": 6 * n_matmul + 12 * attn, "eval": 2 * n_matmul + 4 * attn}  # per token
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
        "peak_mem_mb": None if args.no_memory else c.peak_bytes / 2 ** 20, "warmup_s": first_s[c.name]}
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
    if args.peak_tflops:
        out["mfu_vs_spec_peak"] = {c.name: flops["train"] * B * T / statistics.median(c.train_s) / 1e12
                                   / args.peak_tflops for c in contestants}
    if args.loop_repeats:
        precision = "bf16-mixed" if args.precision == "bf16" else "32-true"
        out["lightning_loop"] = lightning_loop_cost(cfg, lit, batches[:args.loop_steps + 1], precision, device,
                                                    sync, args.loop_repeats)
    out["targets"] = check_targets(out)
    return out


def check_targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets that this run can speak to, each with the measured value and met or not."""
    checks, ratios = [], out["ratios"]
    for kind, (median, floor) in TARGETS.get(out["config"], {}).items():
        r = next(v for k, v in ratios.items() if k.startswith(kind + "_vs_"))
        goal = f">= {median:.2f}x" + (f", no repeat < {floor:.2f}" if floor else "")
        checks.append({"target": f"{kind} vs peer {goal}",
                       "value": f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})",
                       "met": r["median"] >= median and (floor is None or r["min"] >= floor)})
    if out["config"] == "gpt2" and any(k.startswith("mem_vs") for k in ratios):
        mem = next(v for k, v in ratios.items() if k.startswith("mem_vs"))
        checks.append({"target": "peak memory <= 0.80x peer", "value": f"{mem:.3f}", "met": mem <= 0.80})
    if out["config"] == "llama" and out["precision"] == "fp32" and out["device"] == "cpu" and out["threads"] in (1, 2):
        goal = 0.88 if out["threads"] == 1 else 0.85
        mfu = out["results"]["lmlab"]["train_mfu"]
        checks.append({"target": f"train MFU >= {goal:.0%} ({out['threads']} thread(s))", "value": f"{mfu:.1%}",
                       "met": mfu >= goal})
    if "bf16_vs_fp32" in ratios:
        r = ratios["bf16_vs_fp32"]
        checks.append({"target": "bf16-mixed >= 1.50x own fp32", "value": f"{r['median']:.3f}",
                       "met": r["median"] >= 1.5})
    if loop := out.get("lightning_loop"):
        r = loop["ratio_amortised"]["median"]
        checks.append({"target": "Lightning loop + monitor <= 1.10x bare step", "value": f"{r:.3f}", "met": r <= 1.10})
    return checks


def render(out: dict[str, Any]) -> str:
    """The human-readable report: settings, one row per contestant, paired ratios, the loop cost, targets."""
    ceiling = out["ceiling"]["gflops"]
    lines = [f"lmlab.bench  {out['date']}  torch {out['torch']}  transformers {out['transformers']}  "
             f"{out['device']} ({out['cpu']}), {out['threads']} thread(s), {out['precision']}"
             f"{', compiled' if out['compile'] else ''}{', malloc keep' if out['malloc'] == 'keep' else ''}",
             f"config {out['config']}: {out['arch']}",
             f"batch {out['batch']} x seq {out['seq_len']}, vocab {out['vocab']}; {out['repeats']} repeats of "
             f"{out['steps_per_block']} train / {out['eval_steps_per_block']} eval steps per block, order alternating",
             f"FLOPs: {out['flops_formula']}; N = {out['matmul_params']:,}",
             f"ceiling: {out['ceiling']['op']} = {ceiling['median']:.1f} GFLOP/s (median; {ceiling['min']:.1f}-"
             f"{ceiling['max']:.1f})", "",
             f"{'model':<24}{'params':>12}{'train tok/s':>13}{'train MFU':>11}{'eval tok/s':>12}{'eval MFU':>10}"
             f"{'peak MiB':>10}"]
    for name, r in out["results"].items():
        mem = f"{r['peak_mem_mb']:.1f}" if r["peak_mem_mb"] is not None else "-"
        lines.append(f"{name:<24}{r['params']:>12,}{r['train_tok_s']:>13.0f}{r['train_mfu']:>11.1%}"
                     f"{r['eval_tok_s']:>12.0f}{r['eval_mfu']:>10.1%}{mem:>10}")
    lines += ["", "paired ratios (lmlab speed-up; > 1 = lmlab faster / smaller), median (min-max):"]
    for key, r in out["ratios"].items():
        lines.append(f"  {key:<22}" + (f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" if isinstance(r, dict)
                                       else f"{r:.3f} (lmlab peak / peer peak; < 1 = lmlab smaller)"))
    if loop := out.get("lightning_loop"):
        r, a, m = loop["ratio"], loop["ratio_amortised"], loop["monitor"]
        lines += ["", f"Lightning loop (LitGPT + StabilityMonitor every {m['every_n_steps']} steps, attention figures "
                      f"every {m['attn_every_n_steps']}, metrics.csv) vs bare step, steps 1-{loop['window_steps']} of "
                      "each fit:",
                  f"  {loop['lightning_step_s'] * 1e3:.1f} ms vs {loop['bare_step_s'] * 1e3:.1f} ms per step, ratio "
                  f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f}) over {len(r['all'])} repeats",
                  f"  step 0 (init profile + attention figures) costs {loop['step0_extra_s'] * 1e3:.1f} ms more; "
                  f"amortised over {m['attn_every_n_steps']} steps: ratio {a['median']:.3f} "
                  f"({a['min']:.3f}-{a['max']:.3f})"]
    if out["targets"]:
        lines += ["", "issue targets:"] + [f"  [{'met' if t['met'] else 'MISSED'}] {t['target']}: {t['value']}"
                                           for t in out["targets"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m lmlab.bench", description=__doc__.split("\n")[0])
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
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    out = run(args)
    print(render(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
