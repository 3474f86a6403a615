"""Evaluate trained runs: loss / PPL at the trained length, and zero-shot length extension across RoPE scalings.

A run is rebuilt from what it saved (the GPTConfig in its checkpoint, its tokenizer.json, its data config),
never from the current `conf/`; eval-time changes are explicit: a longer `max_seq_len` and a `rope_scaling`.
Every method is scored on the same validation windows (a paired comparison), and the per-position loss is
split into positions inside the trained length and beyond it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F

from lmlab.analysis.cells import Cells, Interrupted, Progress
from lmlab.config import GPTConfig
from lmlab.data.tasks import module_class
from lmlab.model.gpt import GPT, validate
from lmlab.model.head import HEADS
from lmlab.model.memory import check_attention_fits
from lmlab.model.position import POSITIONS
from lmlab.model.resolve import resolve
from lmlab.model.rope_scaling import ROPE_SCALINGS
from lmlab.record.rundir import RunDir, atomic_write, dumps, load_model, load_run  # noqa: F401  (load_model: public

# here)
from lmlab.record.tables import write_table
from lmlab.registry import PositiveInt, check_values, option_params, option_types, parameter_types
from lmlab.run.attn_entropy import attention_entropy

COLUMNS = ["length", "rope_scaling", "windows", "loss", "ppl", "loss_inside", "loss_beyond",
           "attn_entropy"]  # of each row (attn_entropy: lmlab.run.attn_entropy, on the first ENTROPY_WINDOWS windows)
ENTROPY_WINDOWS = 4


class RunRefused(ValueError):
    """An evaluation that would be meaningless (beyond a scheme's reach), refused with the reason."""


def run_note(run_dir: str | Path) -> tuple[str, str | None]:
    """The run's status, and a sentence when it didn't complete: its weights are those of its last checkpoint."""
    summary = RunDir(run_dir).read_summary() or {}
    status = summary.get("status") or RunDir(run_dir).state()
    if status == "completed":
        return status, None
    if status in ("diverged", "collapsed"):
        return status, (f"the run {status} at step {summary.get('diverged_at_step')} "
                        f"({summary.get('divergence_reason')}): these figures are of its last checkpoint")
    return status, f"the run is {status} (step {summary.get('steps')}): these figures are of its last checkpoint"


def run_data(run_dir: str | Path, run_cfg: dict[str, Any], seq_len: int):
    """The run's validation data, tokenized with the run's own tokenizer.json."""
    from omegaconf import OmegaConf


    data = OmegaConf.to_container(OmegaConf.create({"data": run_cfg["data"]}), resolve=True)["data"]
    task = module_class(data.get("name"))
    if not task.evaluable:
        raise ValueError(f"run={run_dir} trained on data={data['name']}, a task, not text: eval.py measures loss on "
                         f"a corpus's validation text. The task's own figures are in <run>/{task.figures_file} and "
                         f"summary.json; eval.py compare=<sweep> tabulates and plots them")
    data["tokenizer"] = str(Path(run_dir) / "tokenizer.json")  # the run's own tokenizer
    dm = module_class(data.get("name"))(data, seq_len=seq_len, seed=run_cfg.get("seed", 0))
    dm.setup("validate")
    return dm


def extension_model(model_cfg: dict[str, Any], weights: dict[str, torch.Tensor], length: int,
                    scaling: dict[str, Any] | None) -> GPT:
    """The run's model set to run at `length`, trained length kept as `train_len`, with `scaling` applied."""
    cfg = dict(model_cfg)
    cfg["train_len"] = cfg.get("train_len") or cfg["max_seq_len"]
    if scaling is not None:
        cfg["rope_scaling"] = dict(scaling)
    if not POSITIONS[cfg["position"]["name"]].table_bound:  # a learned table keeps its size
        cfg["max_seq_len"] = length
    model = GPT(validate(GPTConfig(**cfg)))
    model.load_state_dict(weights)
    return model.eval()


@torch.no_grad()
def position_losses(model: GPT, windows: torch.Tensor, batch_size: int = 8,
                    tick: Callable[[int], None] | None = None) -> torch.Tensor:
    """Mean next-token loss at each position over the windows, (length,), from one full-length forward each; `tick`
    is told the tokens of each batch done (lmlab.analysis.cells.Progress)."""
    total = torch.zeros(windows.size(1) - 1, dtype=torch.float64)
    for chunk in windows.split(batch_size):
        x, y = chunk[:, :-1], chunk[:, 1:]
        logits = model(x).float()  # (B, T, V)
        loss = F.cross_entropy(logits.transpose(1, 2), y, reduction="none")  # (B, T)
        total += loss.sum(0).double()
        if tick is not None:
            tick(x.numel())
    return total / windows.size(0)


@torch.no_grad()
def dynamic_position_losses(model: GPT, windows: torch.Tensor, trained: int, step: int, batch_size: int = 8,
                            tick: Callable[[int], None] | None = None) -> torch.Tensor:
    """Per-position loss as a dynamic scaling sees the text while it grows: positions < trained from one forward
    of length `trained` (s = 1, exactly the unscaled model), then each block of `step` positions from a forward of
    the prefix that ends with it (s = prefix / trained). One full-length forward would apply the final s to
    every position, which is static scaling, not dynamic."""
    T = windows.size(1) - 1
    out = torch.empty(T, dtype=torch.float64)
    start = 0
    for end in _dynamic_ends(T, trained, step):
        out[start:end] = position_losses(model, windows[:, : end + 1], batch_size, tick)[start:end]
        start = end
    return out


def _dynamic_ends(T: int, trained: int, step: int) -> list[int]:
    """The prefixes dynamic scaling is evaluated at: the trained length, then every `step` positions up to T."""
    return [min(end, T) for end in [min(trained, T), *range(min(trained, T) + step, T + step, step)]]


def default_scalings(position: str) -> list[str]:
    """Every method, and next to each one with a `ramp` its paper-ramp variant (`yarn:ramp=ratio`, YaRN's
    Definition 2), so the sweep says which ramp a result needs."""
    if not POSITIONS[position].accepts_scaling:
        return ["none"]
    return [m for name in sorted(ROPE_SCALINGS)
            for m in [name, *([f"{name}:ramp=ratio"] if "ramp" in option_types(ROPE_SCALINGS[name]) else [])]]


def scaling_spec(method: str) -> dict[str, Any]:
    """A swept method as a rope_scaling spec: `name`, or `name:key=value` for one setting (`yarn:ramp=ratio`);
    checked against the option's keys. On the command line quote it: `rope_scaling="yarn,'yarn:ramp=ratio'"`."""
    import yaml

    name, colon, setting = method.partition(":")
    key, eq, value = setting.partition("=")
    if colon and not (key and eq and value):
        raise ValueError(f"rope_scaling={method!r}: write a method as name or name:key=value (e.g. yarn:ramp=ratio)")
    if name not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling={name!r} is not an option; choose among {sorted(ROPE_SCALINGS)}")
    spec = {"name": name, **({key: yaml.safe_load(value)} if colon else {})}
    option_params("rope_scaling", ROPE_SCALINGS, spec)
    return spec


def check_reach(position: str, scaling: str, length: int, trained: int, allow_extrapolation: bool) -> None:
    cls = POSITIONS[position]
    if length <= trained:
        return
    if cls.table_bound:
        raise RunRefused(f"position=learned has {trained} positions; it cannot evaluate length {length}")
    if scaling == "none" and not cls.extrapolates and not allow_extrapolation:
        raise RunRefused(f"length {length} > trained length {trained} with position={position} and no "
                         f"rope_scaling: refused, as serving engines refuse past max context. Pick a rope_scaling "
                         f"method or pass allow_extrapolation=true")


def evaluate(run_dir: str | Path, lengths: Sequence[PositiveInt] | None = None, scalings: Sequence[str] | None = None,
             allow_extrapolation: bool = False, batch_size: PositiveInt = 8, out_dir: str | Path | None = None,
             max_windows: PositiveInt | None = 64, dynamic_step: PositiveInt | None = None,
             weights: Literal["live", "ema"] = "live", merge: str | None = None) -> dict[str, Any]:
    """Val loss at the trained length, then the length sweep; writes eval.{md,csv,json} and plots/ into out_dir.
    `weights`: the run's live weights, or `ema` its weight EMA (a run with optim.ema > 0; lmlab.optim.ema).
    `merge`: `last:k[:linear]`, the average of the run's last k step checkpoints instead (lmlab.record.merge)."""
    # The arguments, by the types and ranges of the signature (named as eval.py's keys), before the run is loaded.
    args = {"lengths": lengths, "allow_extrapolation": allow_extrapolation, "batch_size": batch_size,
            "max_windows": max_windows, "dynamic_step": dynamic_step, "weights": weights, "merge": merge}
    check_values("", args, parameter_types(evaluate, ("POSITIONAL_OR_KEYWORD",)))
    for s in scalings or []:
        scaling_spec(s)  # raises naming the choices
    run_dir = Path(run_dir)
    saved = load_run(run_dir)
    model_cfg, run_cfg = saved.model, saved.config
    if not HEADS[head := (model_cfg.get("head") or {}).get("name", "next")].predicts_next:
        raise RunRefused(f"run={run_dir} trained head={head}, which does not predict the next token: its val/loss in "
                         f"summary.json (final_val_loss) is its own objective's (head=mlm: the masked-token loss on "
                         f"fixed masks, comparable across runs); eval.py's next-token loss per length does not apply")
    merged = None
    if merge is not None:  # the last k step checkpoints' average (checkpoint.keep_last), over the live weights only
        from lmlab.record.merge import merged_weights, parse_merge

        parse_merge(merge)
        if weights != "live":
            raise ValueError(f"merge={merge} averages the step checkpoints' live weights: it takes weights=live "
                             f"(got weights={weights})")
        state, merged = merged_weights(saved, merge)
    else:
        state = saved.weights if weights == "live" else saved.build(weights).state_dict()  # tied weights follow
    run_status, note = run_note(run_dir)
    trained = model_cfg.get("train_len") or model_cfg["max_seq_len"]
    position = model_cfg["position"]["name"]
    lengths = sorted(set(lengths or [trained]))
    scalings = list(scalings or default_scalings(position))
    for s in scalings:
        if s != "none" and not POSITIONS[position].accepts_scaling:
            raise ValueError(f"rope_scaling={s!r} needs position=rope (the run has position={position!r})")
    heads = resolve(GPTConfig(**model_cfg)).attn_heads
    for length in lengths:  # refuse before computing anything
        for s in scalings:
            check_reach(position, s, length, trained, allow_extrapolation)
        check_attention_fits(f"length {length}", position, heads, length,
                             min(batch_size, max_windows or batch_size))

    from lmlab.data.tokenizer import load_tokenizer

    if (run_dir / "tokenizer.json").is_file():  # one past the model's vocabulary: refused naming both sizes
        load_tokenizer(run_dir / "tokenizer.json", model_cfg["vocab_size"])
    dm = run_data(run_dir, run_cfg, seq_len=trained)
    own = model_cfg.get("rope_scaling") or {"name": "none"}
    step = dynamic_step or max(1, trained // 4)
    spec = {s: own if s == own["name"] else scaling_spec(s) for s in scalings}  # a fine-tuned run keeps its settings
    windows = {length: dm.val_windows(length)[:max_windows] for length in lengths}  # the same for every method
    dynamic = {s: getattr(ROPE_SCALINGS[spec[s]["name"]], "dynamic", False) for s in scalings}
    cost = {(length, s): windows[length].size(0) * sum(_dynamic_ends(length, trained, step) if dynamic[s]
                                                       and length > trained else [length])
            for length in lengths for s in scalings}  # tokens through the model: the progress lines' measure
    cells = None if out_dir is None else Cells(Path(out_dir), {
        "run": str(run_dir.resolve()), "step": saved.step, "checkpoint": _stamp(RunDir(run_dir).last),
        "weights": weights if merged is None else merged, "max_windows": max_windows, "batch_size": batch_size,
        "dynamic_step": step})
    progress = Progress(sum(cost.values()), "eval")
    rows, curves = [], {}
    try:
        for length in lengths:
            for s in scalings:
                if cells is not None and (kept := cells.get((length, s))) is not None:
                    row, curve = kept["row"], kept["curve"]
                    progress.skip(cost[length, s])
                else:
                    row, curve = _cell(model_cfg, state, length, s, spec[s], windows[length], trained, step,
                                       batch_size, dynamic[s], progress.tick)
                    if cells is not None:
                        cells.add((length, s), row=row, curve=curve)
                    progress.cell(f"length {length} rope_scaling={s} loss {row['loss']:.4f}")
                rows.append(row)
                curves.setdefault(s, {})[length] = curve
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (eval.py turns it into one): what was kept, how to finish
        if cells is None:
            raise
        left = len(cost) - len(cells.done)
        raise Interrupted(f"interrupted: {len(cells.done)} of {len(cost)} cells kept in {cells.path}; the same "
                          f"command computes the other {left}") from None
    if cells is not None and cells.kept:
        print(f"eval {run_dir.name}: {cells.kept} of {len(cost)} cells from the interrupted evaluation "
              f"({cells.path.name}), {len(cost) - cells.kept} computed now", file=sys.stderr)
    result = {"run": str(run_dir), "position": position, "trained_len": trained, "rows": rows,
              "run_status": run_status, "note": note, **({"weights": weights} if weights != "live" else {}),
              **({"merge": merged} if merged is not None else {})}
    if out_dir is not None:
        write_eval(result, curves, Path(out_dir))
        cells.finish()
        from lmlab.record.tracking import log_eval

        log_eval(result, Path(out_dir), run_dir, run_cfg, COLUMNS)  # when the run logged to W&B
    return result


def _cell(model_cfg: dict[str, Any], state: dict[str, Any], length: int, s: str, spec: dict[str, Any],
          windows: torch.Tensor, trained: int, step: int, batch_size: int, dynamic: bool,
          tick: Callable[[int], None]) -> tuple[dict[str, Any], list[float]]:
    """One cell of the sweep: the run at `length` under the scaling `s`, its table row and per-position losses."""
    model = extension_model(model_cfg, state, length, spec)
    if dynamic and length > trained:
        per_pos = dynamic_position_losses(model, windows, trained, step, batch_size, tick)
    else:
        per_pos = position_losses(model, windows, batch_size, tick)
    inside, beyond = per_pos[:trained], per_pos[trained:]
    row = {"length": length, "rope_scaling": s, "windows": int(windows.size(0)),
           "loss": float(per_pos.mean()), "ppl": math.exp(min(float(per_pos.mean()), 50)),
           "loss_inside": float(inside.mean()), "loss_beyond": float(beyond.mean()) if beyond.numel() else None,
           "attn_entropy": attention_entropy(model, windows[:ENTROPY_WINDOWS])}
    return row, per_pos.tolist()


def _stamp(path: Path) -> list[int]:
    """A checkpoint's size and modification time: a cell kept from another checkpoint is not reused."""
    st = path.stat()
    return [st.st_size, st.st_mtime_ns]


def write_eval(result: dict[str, Any], curves: dict[str, dict[int, list[float]]], out: Path) -> None:

    out.mkdir(parents=True, exist_ok=True)
    atomic_write(out / "eval.json", dumps({**result, "per_position": curves}))
    write_table(result["rows"], COLUMNS, out / "eval")
    lengths = sorted({r["length"] for r in result["rows"]})
    if len(lengths) > 1 or lengths[0] > result["trained_len"]:
        from lmlab.record.plots import plot_extension, plot_length_sweep

        plot_extension(curves, result["trained_len"], out / "plots" / "length_extension.png")
        if len(lengths) > 1:
            plot_length_sweep(result["rows"], result["trained_len"], out / "plots" / "loss_vs_length.png")
