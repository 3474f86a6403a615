"""experiment=optimizer_benchmark read back: optimizers compared as the speedrun's optimizer track compares them.

The protocol (conf/experiment/optimizer_benchmark.yaml): one architecture, data and batch; each optimizer (`optim`)
trained at every learning rate of one grid (`optim.lr`) with the same n seeds, at two widths. An *arm* is an
optimizer at a width. The readout, for `eval.py compare=<sweep>` (a section of its report) and
`python -m lmlab.analysis.studies optimizer_benchmark <sweep>`:

- **A held-out split.** Each run's last weights are scored on the validation part's windows cut in two by position:
  the first half (`tune`) picks each arm's lr, the lowest mean over its seeds (a run that did not complete scores
  +inf); the second half (`test`) gives the final losses the arms are compared on, so the lr chosen is not also the
  one whose noise happened to flatter the comparison. Cached in each run as `held_out.json` (keyed on its
  checkpoint).
- **Per arm at its tuned lr:** the final test loss (mean ± sd over seeds), the steps to a target val loss (where the
  logged validation curve first crosses it, interpolated; mean ± sd over the seeds that reach it), the loss-per-step
  slope at the end (the last two validations, mean over seeds). A tuned lr at the grid's edge is flagged: the grid
  should be widened there.
- **Pairwise verdicts at each width,** by the optimizer track's rule (modded-nanogpt, records/track_3_optimization:
  "(final_loss_diff + exp_stepbased_loss_diff) / (1/n1 + 1/n2)**0.5 >= 0.004", `verdict`), its constants measured
  on these runs rather than copied: `better`, `worse` or `not resolved` at one-sided p < 0.01, with n. The loss gap
  is also given in steps, the track's currency (Δloss over the pair's loss-per-step slope at the end), and the paired
  t test over shared seeds beside it.
- **The trend with size:** each arm's steps to target relative to the first optimizer's at the same width.

The target at each width (unless `target=` is given) is the highest of the arms' mean final val losses at their tuned
lr, rounded up: every arm reaches it on average, the slow ones at their end.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmlab import names
from lmlab.analysis.sections import LR, SEED, Sweep, section
from lmlab.analysis.significance import paired
from lmlab.record.rundir import atomic_write
from lmlab.record.targets import crossing

OPTIM, HELD_OUT = "optim", "held_out.json"
Z_TRACK = 2.326  # one-sided p < 0.01: the track's 0.004 is this times the sd of its runs' final losses (~0.0017)


@dataclass
class Run:
    seed: str
    lr: str
    completed: bool
    tune: float | None  # mean loss on the validation part's first half (None: not scored)
    test: float | None  # on its second half
    curve: list[tuple[int, float]] = field(default_factory=list)  # the logged val loss over steps


@dataclass
class Arm:
    optim: str
    at: str  # the other keys' values: the width
    runs: dict[str, dict[str, Run]] = field(default_factory=dict)  # lr -> seed -> run

    def tuning(self) -> dict[str, float]:
        """Each lr's mean tune loss over its seeds (+inf where a seed did not complete or was not scored)."""
        return {lr: statistics.fmean(r.tune if r.completed and r.tune is not None else math.inf
                                     for r in seeds.values()) for lr, seeds in self.runs.items()}

    @property
    def lr(self) -> str:
        tuning = self.tuning()
        return min(tuning, key=lambda lr: (tuning[lr], float(lr)))

    @property
    def at_edge(self) -> bool:
        grid = sorted(self.runs, key=float)
        return len(grid) > 1 and self.lr in (grid[0], grid[-1])

    @property
    def tuned(self) -> dict[str, Run]:
        return self.runs[self.lr]

    def finals(self) -> dict[str, float]:
        """Seed -> final test loss at the tuned lr (completed runs)."""
        return {s: r.test for s, r in self.tuned.items() if r.completed and r.test is not None}

    def final_val(self) -> float | None:
        finals = [r.curve[-1][1] for r in self.tuned.values() if r.completed and r.curve]
        return statistics.fmean(finals) if finals else None

    def steps_to(self, target: float) -> list[float | None]:
        return [crossing(r.curve, target) if r.completed else None for r in self.tuned.values()]

    def slope(self) -> float | None:
        """Loss per step at the end: (v[-2] − v[-1]) / (s[-1] − s[-2]) of the tuned runs' val curves, their mean."""
        slopes = [(r.curve[-2][1] - r.curve[-1][1]) / (r.curve[-1][0] - r.curve[-2][0])
                  for r in self.tuned.values() if r.completed and len(r.curve) >= 2]
        return statistics.fmean(slopes) if slopes else None


def held_out(run: Path) -> tuple[float, float]:
    """(tune, test): the mean next-token loss of the run's last weights on the first and the second half of its
    validation windows at the trained length; remembered in the run directory, keyed on its checkpoint."""
    from lmlab.analysis.evaluate import position_losses, run_data
    from lmlab.record.rundir import RunDir, load_run

    ckpt = RunDir(run).last
    key = f"{ckpt.name}:{ckpt.stat().st_mtime_ns}:{ckpt.stat().st_size}"
    memo = run / HELD_OUT
    if memo.is_file() and (kept := json.loads(memo.read_text())).get("checkpoint") == key:
        return kept["tune"], kept["test"]
    saved = load_run(run)
    length = saved.model.get("train_len") or saved.model["max_seq_len"]
    windows = run_data(run, saved.config, seq_len=length).val_windows(length)
    half = len(windows) // 2
    if half == 0:
        raise ValueError(f"{run}: one validation window of {length + 1} tokens: no held-out half to split off")
    model = saved.build()
    tune, test = (float(position_losses(model, w).mean()) for w in (windows[:half], windows[half:2 * half]))
    atomic_write(memo, json.dumps({"checkpoint": key, "tune": tune, "test": test, "windows": half}))
    return tune, test


def arms(sweep: Sweep) -> list[Arm]:
    """The sweep's arms, in the report's order, their runs scored on the held-out halves."""
    others = [k for k in sweep.variant_keys if k not in (OPTIM, LR)]
    out: dict[tuple[str, str], Arm] = {}
    for run in sweep.runs:
        o, s = sweep.overrides[run], sweep.summaries[run]
        at = ",".join(f"{k}={o.get(k, '')}" for k in others)
        arm = out.setdefault((at, o.get(OPTIM, "")), Arm(o.get(OPTIM, ""), at))
        completed = s.get("status") == "completed"
        tune = test = None
        if completed:
            try:
                tune, test = held_out(run)
            except (FileNotFoundError, ValueError) as e:  # no checkpoint kept, or no validation to split
                sweep.notes.append(f"optimizer_benchmark: {run.name} not scored on the held-out halves ({e})")
        curve = [(int(st), float(v)) for st, v in sweep.logged.get(run, {}).get(names.VAL_LOSS, [])]
        arm.runs.setdefault(o.get(LR, ""), {})[o.get(SEED, "0")] = Run(o.get(SEED, "0"), o.get(LR, ""), completed,
                                                                        tune, test, curve)
    return list(out.values())


def _mean_sd(values: Sequence[float], digits: int = 3) -> str:
    if not values:
        return "—"
    mean = f"{statistics.fmean(values):.{digits}f}"
    return mean + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def pooled_sd(*groups: Sequence[float]) -> float | None:
    """The pooled sample sd of the groups' values (each group about its own mean)."""
    df = sum(len(g) - 1 for g in groups)
    if df < 1:
        return None
    return math.sqrt(sum((len(g) - 1) * statistics.variance(g) for g in groups if len(g) > 1) / df)


def verdict(a: Arm, b: Arm) -> dict[str, Any]:
    """`a` against `b` (same width) by the optimizer track's pairwise rule: with mean final losses L and seed counts
    n, and the steps each trained, a is better when

        (L_b − L_a + slope·(steps_b − steps_a)) / √(1/n_a + 1/n_b) ≥ z·σ

    and worse when the left side is ≤ −z·σ, else not resolved. The track writes the right side as 0.004 and the slope
    as 0.0045 loss per 100 steps, both from its runs; here σ is the pooled sd of the pair's final losses over seeds,
    z = 2.326 (one-sided p < 0.01), and the slope the pair's loss per step at the end, measured on these runs. The
    left side over σ is the z statistic (its one-sided p given), and the loss gap is also given in steps at the slope.
    The paired t test over shared seeds (the same seed: the same data order and initial weights) is given beside it."""
    from scipy import stats

    fa, fb = list(a.finals().values()), list(b.finals().values())
    slopes = [s for s in (a.slope(), b.slope()) if s is not None and s > 0]
    slope = statistics.fmean(slopes) if slopes else None
    out: dict[str, Any] = {"a": a.optim, "b": b.optim, "at": a.at, "n": (len(fa), len(fb)), "slope": slope,
                           "diff": None, "lhs": None, "threshold": None, "sigma": None, "p": None, "steps": None,
                           "paired_p": paired(b.finals(), a.finals()).p, "verdict": f"no test (n={len(fa)}, {len(fb)})"}
    sigma = pooled_sd(fa, fb)
    if not fa or not fb or sigma is None:
        return out
    gap = statistics.fmean(fb) - statistics.fmean(fa)  # positive: a lower, better
    steps_a, steps_b = (statistics.fmean(r.curve[-1][0] for r in arm.tuned.values() if r.completed and r.curve)
                        for arm in (a, b))
    lhs = (gap + (slope or 0.0) * (steps_b - steps_a)) / math.sqrt(1 / len(fa) + 1 / len(fb))
    threshold = Z_TRACK * sigma
    word = ("better" if lhs > 0 and lhs >= threshold else "worse" if lhs < 0 and -lhs >= threshold
            else "not resolved")
    z = lhs / sigma if sigma > 0 else math.copysign(math.inf, lhs) if lhs else 0.0
    out.update(diff=gap, lhs=lhs, threshold=threshold, sigma=sigma, verdict=word,
               p=float(stats.norm.sf(abs(z))), steps=None if slope is None else gap / slope)
    return out


def verdict_line(v: dict[str, Any]) -> str:
    """`muon vs adamw (model.d_model=64): better (by +0.041 in final test loss, ≈ +120 steps at 3.4e-04 loss/step;
    track statistic 0.025 ≥ 2.326σ = 0.004, z p=1e-05; paired t p=0.002; n=4, 4 seeds)`."""
    head = f"{v['a']} vs {v['b']}" + (f" ({v['at']})" if v["at"] else "")
    if v["lhs"] is None:
        return f"{head}: {v['verdict']}"
    gain = f"by {v['diff']:+.4f} in final test loss"
    if v["steps"] is not None:
        gain += f", ≈ {v['steps']:+.0f} steps at {v['slope']:.2g} loss/step"
    sign = "≥" if abs(v["lhs"]) >= v["threshold"] else "<"
    paired_p = "" if v["paired_p"] is None else f"; paired t p={v['paired_p']:.2g}"
    return (f"{head}: {v['verdict']} ({gain}; track statistic {v['lhs']:+.4f}, |·| {sign} {Z_TRACK}σ = "
            f"{v['threshold']:.4f}, one-sided p={v['p']:.2g}{paired_p}; n={v['n'][0]}, {v['n'][1]} seeds)")


def report(found: list[Arm], target: float | None = None) -> tuple[str, list[dict[str, Any]], list[dict[str, Any]]]:
    """The markdown, the per-arm rows and the pairwise verdicts."""
    by_at: dict[str, list[Arm]] = defaultdict(list)
    for arm in found:
        by_at[arm.at].append(arm)
    rows, pairs = [], []
    lines = ["", "Optimizer benchmark: each optimizer at its own best lr (chosen on the first half of the validation "
             "windows), compared on the second half; verdicts by the speedrun optimizer track's rule at one-sided "
             "p < 0.01, the paired t test over seeds beside it", "",
             "| width | optimizer | tuned lr | final test loss | steps to target | vs first | end slope (loss/step) "
             "| seeds |", "|---|---|---|---|---|---|---|---|"]
    first_steps: dict[str, float | None] = {}
    for at, group in by_at.items():
        finals = [f for arm in group if (f := arm.final_val()) is not None]
        goal = target if target is not None else (math.ceil(max(finals) * 1000) / 1000 if finals else None)
        for i, arm in enumerate(group):
            hits = arm.steps_to(goal) if goal is not None else []
            reached = [h for h in hits if h is not None]
            mean_steps = statistics.fmean(reached) if reached and len(reached) == len(hits) else None
            if i == 0:
                first_steps[at] = mean_steps
            ratio = (mean_steps / first_steps[at] if mean_steps is not None and first_steps[at] else None)
            steps = ("—" if goal is None else "not reached" if not reached else _mean_sd(reached, 0)
                     + ("" if len(reached) == len(hits) else f" ({len(reached)}/{len(hits)} seeds)"))
            slope = arm.slope()
            finals_ = arm.finals()
            row = {"at": at, "optim": arm.optim, "lr": arm.lr, "at_edge": arm.at_edge, "target": goal,
                   "test_mean": statistics.fmean(finals_.values()) if finals_ else None,
                   "test_sd": statistics.stdev(finals_.values()) if len(finals_) > 1 else None,
                   "steps_mean": mean_steps, "steps": reached, "relative_steps": ratio, "slope": slope,
                   "tuning": arm.tuning(), "seeds": len(arm.tuned)}
            rows.append(row)
            lines.append(f"| {at or '—'} | {arm.optim} | {arm.lr}{' (grid edge)' if arm.at_edge else ''} | "
                         f"{_mean_sd(list(finals_.values()))} | {steps} | "
                         f"{'—' if ratio is None else f'{ratio:.2f}×'} | {'—' if slope is None else f'{slope:.2g}'} | "
                         f"{len(finals_)}/{len(arm.tuned)} |")
        lines.append(f"| {at or '—'} | target val loss | {goal if goal is not None else '—'} | | | | | |")
        for i, a in enumerate(group):
            for b in group[i + 1:]:
                pairs.append(verdict(b, a))
    lines += ["", "Pairwise (the later optimizer against the earlier, same width):", ""]
    lines += [f"- {verdict_line(v)}" for v in pairs]
    return "\n".join(lines) + "\n", rows, pairs


def plot(found: list[Arm], rows: list[dict[str, Any]], path: Path) -> None:
    """Per width: each arm's mean val curve at its tuned lr with the target; each optimizer's tune loss over the lr
    grid (its sensitivity)."""
    from lmlab.record.plots import _plt, _save

    plt = _plt()
    widths = list(dict.fromkeys(arm.at for arm in found))
    fig, axes = plt.subplots(len(widths), 2, figsize=(11, 3.6 * len(widths)), squeeze=False)
    targets = {r["at"]: r["target"] for r in rows}
    for (curves, grid), at in zip(axes, widths):
        for arm in (a for a in found if a.at == at):
            runs = [dict(r.curve) for r in arm.tuned.values() if r.completed and r.curve]
            steps = sorted(set.intersection(*(set(c) for c in runs))) if runs else []
            if steps:
                curves.plot(steps, [statistics.fmean(c[s] for c in runs) for s in steps],
                            label=f"{arm.optim} (lr {arm.lr})")
            tuning = sorted(((float(lr), v) for lr, v in arm.tuning().items()), key=lambda p: p[0])
            grid.plot([lr for lr, _ in tuning], [v if math.isfinite(v) else float("nan") for _, v in tuning],
                      marker="o", label=arm.optim)
        if targets.get(at) is not None:
            curves.axhline(targets[at], color="grey", linestyle=":", label="target")
        curves.set(xlabel="step", ylabel="val loss (mean over seeds)", title=f"{at or 'the sweep'}: tuned arms")
        grid.set(xscale="log", xlabel="optim.lr", ylabel="tune-half loss (mean over seeds)",
                 title=f"{at or 'the sweep'}: lr sensitivity")
        curves.legend(fontsize=8)
        grid.legend(fontsize=8)
    _save(fig, path)


@section(60)
def optimizer_benchmark(sweep: Sweep) -> str:
    """The benchmark's table, verdicts and picture, for a sweep over optimizers, their lrs and seeds."""
    if not {OPTIM, LR, SEED} <= set(sweep.varying):
        return ""
    found = arms(sweep)
    md, rows, pairs = report(found)
    atomic_write(sweep.dir / "optimizer_benchmark.md", md)
    atomic_write(sweep.dir / "optimizer_benchmark.json", json.dumps({"arms": rows, "pairs": pairs}, indent=1))
    plot(found, rows, sweep.dir / "plots" / "optimizer_benchmark.png")
    return md
