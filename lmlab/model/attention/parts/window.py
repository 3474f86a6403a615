"""Which window a layer reads when: windows counted in blocks, a schedule over training, windows for evaluation only
(the GPT-2 speedrun's attention-window schedules). The masks themselves are lmlab.model.mask's.

Keys (conf/attention_base/shared.yaml), beside attention.window and attention.pattern, which stay the model's windows
(what a model reads with no step set: eval.py, generation, export):
- window_block g: every window counted in whole blocks of g tokens (record 16, 2024-12-10_MFUTweaks: g = 128). The
  query at position p, in block b = ⌊p/g⌋, reads the keys of blocks b - W/g + 1 .. b, causally within its own
  (mask.BlockWindow). Every window (window, pattern, the schedule's, eval_window) is a multiple of g.
- window_schedule: the windows in training, a function of the step s out of N = trainer.max_steps alone (a resumed
  run reads at step s what the uninterrupted one read), in one of two forms:
  - stages [[f_0, w_0], [f_1, w_1], ...] with 0 = f_0 < f_1 < ... <= 1: w_i from step ⌈f_i·N⌉ on. Also spelled
    {stages: [...]}, the mapping a config can lay over a linear warm-up an earlier one set (its keys nulled).
    Record 29 (2025-09-03_FA3): (3, 7, 11) blocks of 128 in thirds of the run for the long layers, ws // 2 blocks
    for the short ones (its stage index ⌊3s/(N + 1)⌋: fractions k(N + 1)/3N); record 72 (2026-02-10_ShortWindow):
    (short, long) = (1, 3), (3, 7), (2, 11), (6, 13) blocks from steps 0, 505, 1010, 1515 of 1555;
  - linear {start, end, multiple, round}: x = start + (end - start)·s/N rounded to a multiple of `multiple` (down,
    nearest or up; default window_block, else 1), at least one multiple. Record 13 (2024-11-24_WindowWarmup):
    {start: 64, end: 1792, multiple: 64} (64·⌊(64 + 1728·s/N)/64⌋, a token mask); record 16: {start: 64, end: 1792,
    multiple: 128, round: nearest} under window_block=128 (⌊(lerp(64, 1792) + 64)/128⌋ blocks, 1 → 14); record 20
    (2025-01-16_Sub3Min)'s sizes: {start: 0, end: 1728, multiple: 128, round: up}.
  A schedule ends at the model's windows: its last stage, or the linear form at s = N, gives attention.window /
  pattern (the windows evaluation, generation and export read).
- eval_window: the windows whenever the model is not training: every validation, eval.py, generation (the KV cache
  keeps W - 1 keys of it). Records 33 (2025-09-15: the final layer's window 20 blocks, the other long ones 13) and 35
  (2025-09-21: every long layer's 20, the short ones 6) use theirs at the last validation only; here every
  validation reads it. Null: validation reads the schedule's window at its step (record 13's), evaluation the
  model's windows.

A window value (a stage's w_i, the linear x, eval_window) is a number or a list like attention.pattern. A number is
the window of the layers with the longest window (the records' long layers); every other windowed layer scales by the
same ratio, w_l -> ⌊w_l·x/W_max⌋ rounded down to a multiple of g (at least g), so built at 11 and 5 blocks the short
layers read ws // 2 blocks at ws = 3, 7, 11 as record 29's; global layers stay global. A list gives each pattern
entry its own window (a number, or global): record 72's stage 3, or record 33's final layer. FlashAttention 3's
window_size=(w, 0) (records 29 on) reads w + 1 keys: lmlab's window w + 1, which only a list states exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from lmlab.model.attention.parts import Part
from lmlab.model.mask import BlockWindow, layer_window
from lmlab.registry import PositiveInt

if TYPE_CHECKING:
    from lmlab.config import GPTConfig

Value = int | tuple[int | None, ...]  # a window value: a number, or a window (None: global) per pattern entry
ROUNDS = ("down", "nearest", "up")


@dataclass(frozen=True)
class Linear:
    """The linear form: start + (end - start)·s/N, rounded to a multiple of `multiple` (`round`), at least one."""

    start: int
    end: int
    multiple: int
    round: str

    def at(self, step: int, max_steps: int) -> int:
        """The window at step `step` of `max_steps` (past the end: the end's), in integers (the records' floats give
        the same numbers: their steps never land on a rounding boundary but at the ends)."""
        s, N, m = min(step, max_steps), max_steps, self.multiple
        num = self.start * N + (self.end - self.start) * s  # x = num / N
        blocks = {"down": num // (m * N), "nearest": (2 * num + m * N) // (2 * m * N),
                  "up": -(-num // (m * N))}[self.round]
        return m * max(1, blocks)


@dataclass(frozen=True)
class LayerWindows:
    """One layer's window over a run: `at(step, max_steps, training)`. `built`: attention.window / pattern's (None:
    the whole context), read with no step (eval.py, generation, export) and at the schedule's end."""

    built: int | None
    longest: int  # the longest window of any layer: what a number value is the window of
    entry: int | None  # this layer's attention.pattern entry (a list value's), None without a pattern
    block: int  # attention.window_block (1: single tokens)
    stages: tuple[tuple[float, Value], ...] | None = None
    linear: Linear | None = None
    eval: Value | None = None

    @property
    def moves(self) -> bool:
        """Whether the window depends on the step or on the mode (a schedule or an eval window is set)."""
        return self.stages is not None or self.linear is not None or self.eval is not None

    def at(self, step: int | None, max_steps: int | None, training: bool) -> int | None:
        """The window in force: eval_window when not training (if set); the schedule's at `step` of `max_steps`;
        the built window with no step (None)."""
        if not training and self.eval is not None:
            return self.of(self.eval)
        if step is None or max_steps is None:
            return self.of_size(self.built)
        if self.linear is not None:
            return self.of(self.linear.at(step, max_steps))
        if self.stages is not None:
            return self.of([w for f, w in self.stages if stage_start(f, max_steps) <= step][-1])
        return self.of_size(self.built)

    def passed(self, step: int | None, max_steps: int | None, training: bool) -> tuple[int, ...]:
        """The longest layers' windows the stages have gone through by `step` (every stage with no step), then
        eval_window's when not training: the windows position.window_yarn follows (record 31)."""
        values = [v for f, v in self.stages or () if step is None or stage_start(f, max_steps) <= step]
        if not training and self.eval is not None:
            values.append(self.eval)
        return tuple(v if isinstance(v, int) else max(w for w in v if w is not None) for v in values)

    def of(self, value: Value) -> int | None:
        """This layer's window under a window value: its pattern entry's, or a number scaled from the longest
        layers' (global layers stay global)."""
        if isinstance(value, tuple):
            return self.of_size(value[self.entry])
        if self.built is None:
            return None
        g = self.block
        return self.of_size(max(g, self.built * value // (self.longest * g) * g))

    def of_size(self, w: int | None) -> int | None:
        """A window size as the masks read it: counted in blocks under window_block (mask.BlockWindow)."""
        return w if w is None or self.block == 1 else BlockWindow(w, self.block)


def stage_start(fraction: float, max_steps: int) -> int:
    """The first step of a stage that starts at `fraction` of max_steps: ⌈f·N⌉, f·N first rounded to 1e-9 (so
    505/1555 of 1555 steps is step 505, whatever the float's last bit)."""
    return math.ceil(round(fraction * max_steps, 9))


def layer_windows(window: int | None, pattern: list | None, layer: int, n_layer: int, max_len: int, *,
                  window_schedule: list | Mapping | None = None, window_block: int | None = None,
                  eval_window: int | list | None = None) -> LayerWindows:
    """Layer `layer`'s windows from the attention keys, every one checked (raises ValueError naming the key)."""
    built = [layer_window(window, pattern, i, n_layer, max_len) for i in range(n_layer)]
    windows = [w for w in built if w is not None]
    g = window_block or 1
    set_keys = {k: v for k, v in (("window_schedule", window_schedule), ("window_block", window_block),
                                  ("eval_window", eval_window)) if v is not None}
    if set_keys and not windows:
        shown = " ".join(f"attention.{k}={_show(v)}" for k, v in set_keys.items())
        raise ValueError(f"{shown} needs windowed layers, and attention.window={_show(window)} attention.pattern="
                         f"{_show(pattern)} gives none: set attention.window=W (the window the model ends training "
                         f"with; every layer, or the local ones of a pattern)")
    if window_block is not None:
        for key, w in (("attention.window", window), *((f"attention.pattern[{i}]", e)
                                                        for i, e in enumerate(pattern or ()))):
            if isinstance(w, int) and not isinstance(w, bool) and w % g:
                raise ValueError(f"{key}={w} is not a multiple of attention.window_block={g}: windows are counted "
                                 f"in whole blocks; use a multiple of {g} (e.g. {g * max(1, round(w / g))})")
    entry = None if pattern is None else layer % len(pattern)
    out = LayerWindows(built[layer], max(windows, default=1), entry, g)

    def value(key: str, v: Any) -> Value:
        """A window value checked: a number, or a list like attention.pattern (a window or global per entry)."""
        if _is_list(v):
            if pattern is None or len(v) != len(pattern):
                have = "attention.pattern is null" if pattern is None else f"attention.pattern has {len(pattern)}"
                raise ValueError(f"{key}={_show(v)} gives a window per attention.pattern entry, but {have}: give one "
                                 f"number (the longest layers' window; the others scale with it), or one entry per "
                                 f"pattern entry")
            return tuple(None if e == "global" else _size(f"{key}[{i}]", e, max_len, g) for i, e in enumerate(v))
        return _size(key, v, max_len, g)

    stages = linear = None
    if isinstance(window_schedule, Mapping) and window_schedule.get("stages") is not None:
        window_schedule = _stages_of(window_schedule)
    if isinstance(window_schedule, Mapping):
        linear = _linear({k: v for k, v in dict(window_schedule).items() if k != "stages"}, max_len, g)
        end = linear.at(1, 1)
        if end != out.longest:
            raise ValueError(f"attention.window_schedule={_show(window_schedule)} ends at a window of {end} at "
                             f"trainer.max_steps, but the model's longest window (attention.window / pattern) is "
                             f"{out.longest}: the schedule ends at the model's windows (what evaluation and "
                             f"generation read); set attention.window={end}, or end the schedule at {out.longest}")
    elif window_schedule is not None:
        stages = _stages(window_schedule, value)
        last = stages[-1][1]
        model = [LayerWindows(b, out.longest, None if pattern is None else i % len(pattern), g).of(last)
                 for i, b in enumerate(built)]
        if model != built:
            ends = [None if w is None else int(w) for w in model]
            raise ValueError(f"attention.window_schedule's last stage {_show(window_schedule[-1])} gives the layers "
                             f"the windows {ends}, but attention.window / pattern give {built}: the schedule ends at "
                             f"the model's windows (what evaluation and generation read); end it at {out.longest} "
                             f"(the longest layers'; or the pattern's windows, as a list), or change attention.window")
    ev = None if eval_window is None else value("attention.eval_window", eval_window)
    return LayerWindows(out.built, out.longest, entry, g, stages, linear, ev)


def windowed(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` whose window moves with the step or the mode (`LayerWindows.moves`): what the training
    loop hands its step to (`set_step`)."""
    return [m for m in model.modules() if isinstance(getattr(m, "windows", None), LayerWindows) and m.windows.moves]


def _stages_of(spec: Mapping) -> Any:
    """The stages of the mapping spelling {stages: [...]}, the one a config can put over a linear warm-up that an
    earlier config set (Hydra merges a mapping onto a mapping, not a list): the linear keys there must be null."""
    if extra := sorted(k for k, v in spec.items() if k != "stages" and v is not None):
        raise ValueError(f"attention.window_schedule={_show(spec)} gives stages and a linear warm-up's {extra}: one or "
                         f"the other (over a linear warm-up set before, null its keys: "
                         f"{{stages: [...], start: null, end: null, multiple: null, round: null}})")
    return spec["stages"]


def _stages(schedule: Any, value: Any) -> tuple[tuple[float, Value], ...]:
    form = ("a list of [fraction, window] stages (e.g. [[0, 384], [0.33, 896], [0.67, 1408]]) or a linear warm-up "
            "{start: 64, end: 1792, multiple: 64}")
    if not _is_list(schedule) or not schedule or not all(_is_list(s) and len(s) == 2 for s in schedule):
        raise ValueError(f"attention.window_schedule={_show(schedule)} must be {form}")
    out, last = [], None
    for i, (f, w) in enumerate(schedule):
        key = f"attention.window_schedule[{i}]"
        if isinstance(f, bool) or not isinstance(f, int | float) or not 0 <= f <= 1:
            raise ValueError(f"{key}'s fraction {f!r} must be a fraction of trainer.max_steps in [0, 1]")
        if last is None and f != 0:
            raise ValueError(f"attention.window_schedule starts at fraction {f}: its first stage starts at 0 (the "
                             f"window from step 0)")
        if last is not None and f <= last:
            raise ValueError(f"{key}'s fraction {f} must be larger than the stage before's ({last}): stage fractions "
                             f"increase")
        out.append((float(f), value(f"{key}'s window", w)))
        last = f
    return tuple(out)


def _linear(spec: dict[str, Any], max_len: int, g: int) -> Linear:
    unknown = sorted(spec.keys() - {"start", "end", "multiple", "round"})
    missing = sorted({"start", "end"} - spec.keys())
    if unknown or missing:
        raise ValueError(f"attention.window_schedule={_show(spec)}: a linear warm-up takes start and end (windows), "
                         f"multiple and round ({'|'.join(ROUNDS)}); "
                         + (f"it does not take {unknown}" if unknown else f"it needs {missing}"))
    for k in ("start", "end", "multiple"):
        v = spec.get(k, 1)
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if k == "start" else 1):
            raise ValueError(f"attention.window_schedule.{k}={v!r} must be an integer >= {0 if k == 'start' else 1}")
    multiple = spec.get("multiple", g)
    if multiple % g:
        raise ValueError(f"attention.window_schedule's multiple={multiple} is not a multiple of attention.window_block="
                         f"{g}: the windows are whole blocks")
    if (r := spec.get("round", "down")) not in ROUNDS:
        raise ValueError(f"attention.window_schedule's round={r!r} must be one of {list(ROUNDS)}")
    linear = Linear(spec["start"], spec["end"], multiple, r)
    for s in (0, 1):  # a line: its largest window is at one end
        _size(f"attention.window_schedule's window at step {s}·max_steps", linear.at(s, 1), max_len, g)
    return linear


def _size(key: str, w: Any, max_len: int, g: int) -> int:
    if isinstance(w, bool) or not isinstance(w, int) or w < 1:
        raise ValueError(f"{key}={w!r} must be a window of >= 1 keys")
    if w > max_len:
        raise ValueError(f"{key}={w} is larger than the context (model.max_seq_len={max_len}); use a window <= "
                         f"{max_len}")
    if w % g:
        raise ValueError(f"{key}={w} is not a multiple of attention.window_block={g}: windows are counted in whole "
                         f"blocks; use a multiple of {g}")
    return w


def _is_list(v: Any) -> bool:
    return isinstance(v, Sequence) and not isinstance(v, str | bytes)


def _show(v: Any) -> str:
    """A value as the command line writes it."""
    if isinstance(v, Mapping):
        return "{" + ",".join(f"{k}:{_show(x)}" for k, x in v.items()) + "}"
    if _is_list(v):
        return "[" + ",".join(_show(x) for x in v) + "]"
    return "null" if v is None else str(v)



class Windows(Part):
    """attention.window, pattern and what moves them (window_schedule, window_block, eval_window): the layer's
    `windows` (LayerWindows) and the window in force, `window` (None: the whole context), which the attention's
    `set_step` and mode move (lmlab.model.steps)."""

    rank = 0
    always = True

    def __init__(self, attn: nn.Module, cfg: GPTConfig, *, window: int | None = None, pattern: list | None = None,
                 window_schedule: list | dict | None = None, window_block: PositiveInt | None = None,
                 eval_window: int | list | None = None) -> None:
        attn.windows = layer_windows(window, pattern, attn.layer, cfg.n_layer, cfg.max_seq_len,
                                     window_schedule=window_schedule, window_block=window_block,
                                     eval_window=eval_window)
        attn.window = attn.windows.at(None, None, True)

    def keys_read(self, attn: nn.Module, seq_len: int) -> int | None:
        return attn.window  # the window in force (None: the whole context)

    def causal_only(self, attn: nn.Module) -> str | None:
        if attn.window is None:
            return None
        return (f"attention.window / attention.pattern give a layer a window of its last {attn.window} keys, defined "
                f"on the causal past: use attention.window=null and attention.pattern=null")


PARTS = {"window": Windows}
