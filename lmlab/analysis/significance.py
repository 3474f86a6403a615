"""Is a variant's difference from a baseline more than seed noise? Paired tests over shared seeds.

Two variants trained on the same seeds share their data order and (for equal shapes) their initial weights, so the
per-seed differences d_i = variant_i − baseline_i carry much less noise than the two means apart. The test is the
paired t test on them (Student, 1908; scipy.stats.ttest_rel): t = mean(d) / (sd(d)/√n), n − 1 degrees of freedom, a
two-sided p-value and a 95% interval mean(d) ± t_{0.975, n−1}·sd(d)/√n. Over the m variants of a sweep compared with
one baseline, the p-values are Holm-corrected (Holm, 1979): the k-th smallest is multiplied by m − k + 1 and made
monotone, which keeps the family-wise error at α with no assumption on how the tests depend on each other.

Seed-count advice, exact: the smallest n for which a t test at level α (two-sided) has power 1 − β for a
standardized effect d, from the noncentral t (scipy.stats.nct): under the alternative, T follows the noncentral t with
ν degrees of freedom and noncentrality δ, and the power is P(T > t_{1−α/2, ν}) + P(T < −t_{1−α/2, ν}). Paired over n
seeds (d = |mean|/sd of the differences): ν = n − 1, δ = d·√n; two samples of n seeds each (d = |difference|/pooled
sd): ν = 2n − 2, δ = d·√(n/2). It gives Cohen's (1988) and G*Power's counts (two-sample d = 1: 17 per group; paired
d = 0.5: 34 pairs), where the normal approximation n = k·((z_{1−α/2} + z_{1−β})/d)² gives 16 and 32.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from scipy import integrate, stats

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


def t_power(n: int, d: float, alpha: float = ALPHA, paired: bool = True) -> float:
    """The exact power of the two-sided t test at level `alpha` for standardized effect `d`: paired over `n` seeds,
    or two samples of `n` seeds each (the module docstring)."""
    df, nc = (n - 1, d * math.sqrt(n)) if paired else (2 * n - 2, d * math.sqrt(n / 2))
    c = stats.t.ppf(1 - alpha / 2, df)
    right, wrong = stats.nct.sf(c, df, nc), stats.nct.cdf(-c, df, nc)
    if not (math.isfinite(right) and math.isfinite(wrong)):  # scipy's nan: a tail below ~1e-20, or δ ~1e10
        right, wrong = _tail(c, df, nc), _tail(c, df, -nc)
    return float(right + wrong)


def _tail(c: float, df: int, nc: float) -> float:
    """P(T > c) for the noncentral t, by integrating over its denominator: T = (Z + δ)/(X/√ν) with X ~ χ_ν, so
    P(T > c) = ∫ Φ(δ − c·x/√ν) f_χν(x) dx (P(T < −c) is this at −δ)."""
    return float(integrate.quad(lambda x: stats.norm.cdf(nc - c * x / math.sqrt(df)) * stats.chi.pdf(x, df),
                                stats.chi.ppf(1e-15, df), stats.chi.isf(1e-15, df), limit=200)[0])  # X's range


def seeds_needed_exact(d: float, alpha: float = ALPHA, power: float = POWER, paired: bool = True) -> int:
    """The fewest seeds (pairs, or seeds per variant with `paired=False`) for which the t test has power `power` at
    level `alpha` for standardized effect `d` > 0; MAX_SEEDS + 1 past MAX_SEEDS. Power rises with n, so the first n
    found by bisection is the answer."""
    if not d > 0 or not math.isfinite(d):
        raise ValueError(f"the effect d={d!r} must be a finite number > 0 (a difference over its sd)")
    if t_power(MAX_SEEDS, d, alpha, paired) < power:
        return MAX_SEEDS + 1
    low, high = 1, MAX_SEEDS  # power(low) < power <= power(high); n = 1 leaves no degree of freedom (paired)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if t_power(mid, d, alpha, paired) >= power else (mid, high)
    return high


def seeds_needed(mean: float | None, sd: float | None, alpha: float = ALPHA, power: float = POWER) -> int | None:
    """Seeds a paired t test needs to tell a mean difference `mean` from 0 with power `power` at level `alpha` when
    the differences spread by `sd` (the observed figures), exactly (seeds_needed_exact at d = |mean|/sd). None without
    an sd; MAX_SEEDS + 1 past MAX_SEEDS."""
    if mean is None or sd is None:
        return None
    if sd == 0.0:
        return 2 if mean != 0.0 else None
    if mean == 0.0:
        return MAX_SEEDS + 1
    return seeds_needed_exact(abs(mean) / sd, alpha, power, paired=True)


def advice(d: float, alpha: float = ALPHA, power: float = POWER) -> str:
    """`lmlab compare --seeds-needed=<d>`: the seeds a paired and a two-sample t test need for effect `d`."""
    counts = [seeds_needed_exact(d, alpha, power, paired=p) for p in (True, False)]
    said = [f"more than {MAX_SEEDS}" if n > MAX_SEEDS else str(n) for n in counts]
    return (f"effect d={d:g} (a difference over its sd), alpha={alpha:g} two-sided, power={power:g}, exact "
            f"(noncentral t): {said[0]} paired seeds (variant and baseline on the same seeds; sd: of the per-seed "
            f"differences), {said[1]} seeds per variant (two samples; sd: pooled over the runs)")


def verdict(n: int, p_holm: float | None, alpha: float = ALPHA) -> str:
    """The column that says whether a difference stands out of the seed noise."""
    if n < 2 or p_holm is None:
        return f"n={n}: no test (needs 2 shared seeds)"
    return f"yes (p_holm={p_holm:.2g} < {alpha})" if p_holm < alpha else f"no (p_holm={p_holm:.2g})"
