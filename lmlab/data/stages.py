"""The batch size and the sequence length as functions of the step (`data.batch_schedule`, `data.seq_schedule`): the
GPT-2 speedrun's batch-size schedule (record 46: 8, 16 then 24 sequences' worth of tokens in three equal parts of the
run, the lr × (B/B₀)^0.6 with it) and its sequence-length schedule (record 72: shorter sequences early, the tokens per
step unchanged).

A schedule is a list of stages [fraction, value], the fraction of trainer.max_steps where the stage starts (the
first at 0, increasing); stage i runs from step ⌊fᵢ·max_steps⌋. `batch_schedule` gives data.batch_size (sequences per
micro-batch and rank) per stage; `seq_schedule` the length the training blocks are cut into: each block of
model.max_seq_len tokens is read as max_seq_len / s sequences of s (s divides max_seq_len), so a step holds the same
tokens and only attention's cost changes (validation stays at max_seq_len). `data.batch_lr_power` p scales the lr
by (B/B₀)^p, B₀ the first stage's batch (the record's p = 0.6).

Everything here is a function of the step and max_steps alone: a run resumed at step s reads the samples, the lengths
and the lr an uninterrupted run reads there, and the run plan, the budget and `compare`'s tokens and FLOPs to a
target count from the same stages (`table`; lmlab.record.targets.through reads them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

Stages = list[tuple[float, int]]


def check(key: str, stages: Any, *, limit: int | None = None, divides: int | None = None) -> Stages | None:
    """`stages` as [(fraction, value)], checked, naming `key`: a list of [fraction, value] pairs, fractions from 0,
    increasing, below 1; values positive integers (at most `limit`, dividing `divides`)."""
    if stages is None:
        return None
    example = f"e.g. {key}=[[0,8],[0.33,16],[0.66,24]]"
    if isinstance(stages, (str, bytes)) or not isinstance(stages, Sequence) or not stages:
        raise ValueError(f"{key}={stages!r} must be a list of [fraction of trainer.max_steps, value] stages, {example}")
    out: Stages = []
    for stage in stages:
        pair = list(stage) if isinstance(stage, Sequence) and not isinstance(stage, (str, bytes)) else None
        if pair is None or len(pair) != 2 or isinstance(pair[1], bool) or not isinstance(pair[1], int) \
                or isinstance(pair[0], bool) or not isinstance(pair[0], (int, float)):
            raise ValueError(f"{key} has {stage!r}: each stage is [fraction, value] (a number in [0, 1), an integer), "
                             f"{example}")
        out.append((float(pair[0]), int(pair[1])))
    fractions = [f for f, _ in out]
    if fractions[0] != 0 or any(b <= a for a, b in zip(fractions, fractions[1:])) or fractions[-1] >= 1:
        raise ValueError(f"{key}={[list(s) for s in out]}: the stages' fractions start at 0 and increase, below 1 "
                         f"(where each stage starts, as a fraction of trainer.max_steps)")
    for _, value in out:
        if value < 1:
            raise ValueError(f"{key} has the value {value}: a batch size or length is an integer >= 1")
        if limit is not None and value > limit:
            raise ValueError(f"{key} has {value}, past the model's context (model.max_seq_len={limit}): a stage's "
                             f"length is at most max_seq_len")
        if divides is not None and divides % value:
            raise ValueError(f"{key} has {value}, which does not divide model.max_seq_len={divides}: each block of "
                             f"max_seq_len tokens is read as max_seq_len / length sequences")
    return out


def starts(stages: Stages, max_steps: int) -> list[int]:
    """The step each stage starts at, ⌊f·max_steps⌋."""
    return [math.floor(f * max_steps) for f, _ in stages]


def at(stages: Stages | None, step: int, max_steps: int, default: int) -> int:
    """The value in force at `step` (`default` without stages)."""
    if not stages:
        return default
    value = stages[0][1]
    for first, (_, v) in zip(starts(stages, max_steps), stages):
        if step >= first:
            value = v
    return value


def samples_before(step: int, stages: Stages | None, max_steps: int, batch_size: int) -> int:
    """Σ_{t < step} B(t): the samples one rank's micro-batch position has read before optimizer step `step`."""
    if not stages:
        return step * batch_size
    bounds = starts(stages, max_steps) + [math.inf]
    total = 0
    for (first, end), (_, b) in zip(zip(bounds, bounds[1:]), stages):
        total += max(0, min(step, end) - first) * b
    return int(total)


class ScheduledBatches(Sampler[list[int]]):
    """Global sample indices in batches whose size follows the step: micro-batch m is optimizer step
    `start_step` + m // accumulate; of each global batch (B(step) × world samples) rank r takes slice r. Where an
    uninterrupted run stands at a step is a function of the step alone (`samples_before`)."""

    def __init__(self, *, start_step: int, max_steps: int, stages: Stages | None, batch_size: int, rank: int = 0,
                 world_size: int = 1, accumulate: int = 1) -> None:
        self.start_step, self.max_steps, self.stages = start_step, max_steps, stages
        self.batch_size, self.rank, self.world_size, self.accumulate = batch_size, rank, world_size, accumulate

    def __iter__(self) -> Iterator[list[int]]:
        step = self.start_step
        first = samples_before(step, self.stages, self.max_steps, self.batch_size) * self.accumulate * self.world_size
        while True:
            b = at(self.stages, step, self.max_steps, self.batch_size)
            for _ in range(self.accumulate):
                yield list(range(first + self.rank * b, first + (self.rank + 1) * b))
                first += self.world_size * b
            step += 1


def table(max_steps: int, batch: Stages | None, seq: Stages | None, *, batch_size: int, seq_len: int,
          per_batch: int, flops_per_token: Callable[[int], float]) -> list[dict[str, Any]]:
    """The run's stages as `summary.json` keeps them: from each step where the batch or the length changes, the
    tokens per optimizer step (B × max_seq_len × `per_batch`: ranks × accumulation) and the train FLOPs per token at
    that length (`flops_per_token(length)`)."""
    bounds = sorted({0, *(starts(batch, max_steps) if batch else []), *(starts(seq, max_steps) if seq else [])})
    out = []
    for first in (b for b in bounds if b < max(1, max_steps)):
        b, s = at(batch, first, max_steps, batch_size), at(seq, first, max_steps, seq_len)
        out.append({"from_step": first, "batch_size": b, "seq_len": s, "tokens_per_step": b * seq_len * per_batch,
                    "flops_per_token": float(flops_per_token(s))})
    return out
