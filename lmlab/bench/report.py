"""The issue's targets, checked against one run, and the printed table."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# The targets: (ratio key, median at least, every repeat at least); MFU and memory are checked apart.
TARGETS = {"llama": {"train": (1.00, 0.95), "eval": (1.00, 0.95)},
           "gpt2": {"train": (1.10, None), "eval": (1.10, None)},
           "small": {"train": (1.15, None), "eval": (1.15, None)}}


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
             f"{'peak MiB':>10}{'optim MiB':>11}"]
    for name, r in out["results"].items():
        mem = f"{r['peak_mem_mb']:.1f}" if r["peak_mem_mb"] is not None else "-"
        lines.append(f"{name:<24}{r['params']:>12,}{r['train_tok_s']:>13.0f}{r['train_mfu']:>11.1%}"
                     f"{r['eval_tok_s']:>12.0f}{r['eval_mfu']:>10.1%}{mem:>10}"
                     f"{r.get('optim_state_bytes', 0) / 2 ** 20:>11.2f}")
    lines += ["", "paired ratios (lmlab speed-up; > 1 = lmlab faster / smaller), median (min-max):"]
    for key, r in out["ratios"].items():
        lines.append(f"  {key:<22}" + (f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})" if isinstance(r, dict)
                                       else f"{r:.3f} (lmlab peak / peer peak; < 1 = lmlab smaller)"))
    if bd := out.get("breakdown"):
        lines += ["", "where a train step's time goes (torch.profiler self time of one step, scaled to the median "
                      "step; matmul rate = 6*N FLOPs/token over the matmul time):"]
        for name, b in bd.items():
            parts = [f"{k} {s * 1e3:.1f} ms ({b['share'][k]:.0%})" for k, s in b["seconds"].items()]
            lines.append(f"  {name:<22}{b['step_s'] * 1e3:.1f} ms: " + ", ".join(parts))
            vs = f" = {b['matmul_vs_ceiling']:.0%} of the ceiling" if b["matmul_vs_ceiling"] is not None else ""
            lines.append(f"  {'':<22}matmuls at {b['matmul_gflops']:.1f} GFLOP/s{vs}")
    if err := out.get("breakdown_error"):
        lines += ["", f"where a train step's time goes: not measured, the profiler failed ({err})"]
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


def write_json(path: Path | None, out: dict[str, Any]) -> None:
    """A bench's results as JSON at `path` (its folder made), when `--json` asked for them."""
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")
