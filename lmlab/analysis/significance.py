"""Is a variant's difference from a baseline more than seed noise? Paired tests over shared seeds.

Two variants trained on the same seeds share their data order and (for equal shapes) their initial weights, so the
per-seed differences d_i = variant_i − baseline_i carry much less noise than the two means apart. The test is the
paired t test on them (Student, 1908; scipy.stats.ttest_rel): t = mean(d) / (sd(d)/√n), n − 1 degrees of freedom, a
two-sided p-value and a 95% interval mean(d) ± t_{0.975, n−1}·sd(d)/√n. Over the m variants of a sweep compared with
one baseline, the p-values are Holm-corrected (Holm, 1979): the k-th smallest is multiplied by m − k + 1 and made
monotone, which keeps the family-wise error at α with no assumption on how the tests depend on each other.

Seed-count advice: the smallest n for which a paired t test at level α has power 1 − β for the observed mean
difference with the observed sd of the differences, n ≥ ((t_{1−α/2, n−1} + t_{1−β, n−1}) · sd / |mean|)²; the
standard approximation to the noncentral t (it is a little optimistic at n < 5).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import stats

ALPHA, POWER = 0.05, 0.8
MAX_SEEDS = 1000  # advice past this is "more than 1000": the difference is below what seeds can resolve


@dataclass(frozen=True)
class Paired:
    n: int  # the seeds both variants have
    mean: float | None  # mean of variant − baseline over those seeds
    sd: float | None  # sample sd (n − 1) of the differences
    low: float | None  # the 95% t interval of the mean difference
    high: float | None
    p: float | None  # two-sided


def paired(baseline: Mapping[str, float], variant: Mapping[str, float], confidence: float = 0.95) -> Paired:
    """The paired t test of `variant` − `baseline` over the seeds (keys) both have. With one shared seed there is a
    difference but no interval; with identical differences (sd 0) the interval is the point and p is 0 (or 1 when
    the difference is 0 too)."""
    seeds = [s for s in baseline if s in variant]
    d = [float(variant[s]) - float(baseline[s]) for s in seeds]
    n = len(d)
    if n == 0:
        return Paired(0, None, None, None, None, None)
    mean = statistics.fmean(d)
    if n == 1:
        return Paired(1, mean, None, None, None, None)
    sd = statistics.stdev(d)
    if sd == 0.0:
        return Paired(n, mean, 0.0, mean, mean, 1.0 if mean == 0.0 else 0.0)
    se = sd / math.sqrt(n)
    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * se
    p = 2.0 * stats.t.sf(abs(mean / se), n - 1)
    return Paired(n, mean, sd, mean - half, mean + half, float(p))


def holm(pvalues: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of `pvalues` (None: no test, left out of the family and returned as None)."""
    tested = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m, out, running = len(tested), [None] * len(pvalues), 0.0
    for k, (p, i) in enumerate(tested):
        running = max(running, min(1.0, (m - k) * p))
        out[i] = running
    return out


def seeds_needed(mean: float | None, sd: float | None, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Seeds a paired t test needs to tell a mean difference `mean` from 0 with power `power` at level `alpha` when
    the differences spread by `sd` (the observed figures). None without an sd; MAX_SEEDS + 1 past MAX_SEEDS."""
    if mean is None or sd is None:
        return None
    if sd == 0.0:
        return 2 if mean != 0.0 else None
    if mean == 0.0:
        return MAX_SEEDS + 1
    ratio = sd / abs(mean)
    for n in range(2, MAX_SEEDS + 1):
        df = n - 1
        if n >= ((stats.t.ppf(1 - alpha / 2, df) + stats.t.ppf(power, df)) * ratio) ** 2:
            return n
    return MAX_SEEDS + 1


def verdict(n: int, p_holm: float | None, alpha: float = ALPHA) -> str:
    """The column that says whether a difference stands out of the seed noise."""
    if n < 2 or p_holm is None:
        return f"n={n}: no test (needs 2 shared seeds)"
    return f"yes (p_holm={p_holm:.2g} < {alpha})" if p_holm < alpha else f"no (p_holm={p_holm:.2g})"
