"""Scaling-law fits over a size ladder: L(C) = E + A·C^(−α) per variant (Kaplan et al., 2020; Hoffmann et al., 2022
with the irreducible loss E), the compute-equivalent multiplier of a variant against a baseline, and where two fits
cross.

The fit is least squares on the losses with 0 ≤ E ≤ min(L), A ≥ 0, 0 < α ≤ 3 (a loss has a non-negative floor; a
ladder spanning a few decades is otherwise fitted as well by E → −∞, α → 0, a log-linear law). α is found first on a
grid (for a fixed α the model is linear in E and A,
solved exactly), then E, A and α are refined together by scipy.optimize.curve_fit from the best grid point, with C
rescaled by its geometric mean so the three parameters are of order one. The intervals are the 95% t intervals from
curve_fit's covariance (n − 3 degrees of freedom; A's by the delta method on log A, which α moves): with 4
points that is one degree of freedom, and the intervals say how little four points pin down. Fewer points than
parameters are refused, and so are points within a factor MIN_SPAN = 2 of compute (runs at one budget, such as
experiment=depth_width's); with exactly 3 the curve passes through them and has no interval.

Compute-equivalent multiplier at compute C: the baseline reaches L_b(C) there; the variant reaches that loss with
C_v = (A_v / (L_b(C) − E_v))^(1/α_v), and the multiplier is C_v / C (0.8: the variant needs 0.8× the compute; inf:
the variant's fit never gets that low). Crossover: the C where L_v(C) = L_b(C), searched on [C_min/1e6, C_max·1e6].

L(N, D) = E + A/N^α + B/D^β (Hoffmann et al., 2022, their Eq. 2; N the matmul weights, D the training tokens), for a
ladder that varies both: least squares on the losses with the same floor on E, A, B ≥ 0 and 0 < α, β ≤ 3, N and D
rescaled by their geometric means; (α, β) first on a grid (for fixed exponents the model is linear in E, A and B,
solved with its bounds), then all five refined by curve_fit, with 95% t intervals (n − 5 degrees of freedom; A's and
B's by the delta method on their logs). A ladder at fixed tokens per parameter has D ∝ N: A/N^α and B/D^β are then
two power laws of one variable, and the split between them is not measured but guessed — such a ladder (its points
within 0.05 of a line in log N–log D), one N or one D is refused, as are fewer than 5 points. Chinchilla's own fit
used a Huber loss on log L from a grid of starts; with a handful of CPU-scale runs plain least squares on L is
what the intervals are derived for.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, stats

N_PARAMS = 3
ALPHAS = np.linspace(0.01, 2.0, 400)
MIN_SPAN = 2.0  # the least max(C)/min(C) an L(C) fit is run on: closer computes leave α to the noise
ND_PARAMS = 5
ND_EXPONENTS = np.linspace(0.02, 1.5, 38)  # the (α, β) grid of the L(N, D) fit's start
COLLINEAR = 0.05  # rms distance (in log units) of the points from a line in log N–log D below which D ∝ N^b


@dataclass(frozen=True)
class PowerLaw:
    """L(C) = E + A·C^(−α), with 95% intervals (None where the points leave no degree of freedom)."""

    E: float
    A: float
    alpha: float
    n: int
    rmse: float
    E_ci: tuple[float, float] | None = None
    A_ci: tuple[float, float] | None = None
    alpha_ci: tuple[float, float] | None = None
    scale: float = 1.0  # the fit ran on C / scale
    cov: tuple[tuple[float, ...], ...] | None = None  # covariance of (E, A·scale^(−α), α) at that scale

    def band(self, c: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The fit's 95% confidence band at the computes `c` (delta method on the parameters' covariance; None
        without one)."""
        if self.cov is None or self.n <= N_PARAMS:
            return None
        x, a_scaled = np.asarray(c, dtype=float) / self.scale, self.A * self.scale ** -self.alpha
        xa = np.power(x, -self.alpha)
        grad = np.stack([np.ones_like(x), xa, -a_scaled * xa * np.log(x)])  # dL/dE, dL/dA', dL/dα
        var = np.einsum("in,ij,jn->n", grad, np.array(self.cov), grad)
        half = stats.t.ppf(0.975, self.n - N_PARAMS) * np.sqrt(np.clip(var, 0, None))
        mid = self.loss(np.asarray(c, dtype=float))
        return mid - half, mid + half

    def loss(self, c: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A * np.power(c, -self.alpha)

    def compute_for(self, loss: float) -> float:
        """The compute at which the fit reaches `loss` (inf at or below E)."""
        return math.inf if loss <= self.E else (self.A / (loss - self.E)) ** (1.0 / self.alpha)


def _linear(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
    """E, A and the squared error of y ≈ E + A·x (least squares) with 0 ≤ E ≤ min(y) and A ≥ 0: a loss has a
    non-negative floor below every point (clamped to the bound, then A refit, where the free solution leaves it)."""
    design = np.stack([np.ones_like(x), x], axis=1)
    (e, a), *_ = np.linalg.lstsq(design, y, rcond=None)
    if not 0 <= e <= y.min():
        e = float(np.clip(e, 0.0, y.min()))
        a = float(np.dot(x, y - e) / np.dot(x, x))
    a = max(float(a), 0.0)
    return float(e), a, float(np.sum((e + a * x - y) ** 2))


def fit_power_law(compute: Sequence[float], loss: Sequence[float]) -> PowerLaw:
    """The fit of L(C) = E + A·C^(−α) to the points (compute[i], loss[i]); refuses fewer than 3 usable points."""
    pts = [(float(c), float(v)) for c, v in zip(compute, loss) if c and c > 0 and math.isfinite(v)]
    if len(pts) < N_PARAMS:
        raise ValueError(f"a fit of L(C) = E + A·C^(−α) has {N_PARAMS} parameters and needs at least {N_PARAMS} points "
                         f"(sizes that finished with a val loss); got {len(pts)}")
    c, y = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    if c.max() < MIN_SPAN * c.min():
        raise ValueError(f"the points span {c.max() / c.min():.2f}× of compute ({c.min():.4g} to {c.max():.4g} FLOPs): "
                         f"an L(C) fit needs runs over at least {MIN_SPAN:g}× (a ladder of sizes or budgets; runs at "
                         f"one budget.flops compare at equal compute, in compare's table)")
    scale = float(np.exp(np.mean(np.log(c))))
    x = c / scale
    best = min(((*_linear(x ** -a, y), a) for a in ALPHAS), key=lambda t: t[2])
    e0, a0, _, alpha0 = best
    low, high = [0.0, 0.0, ALPHAS[0] / 10], [float(y.min()), np.inf, 3.0]  # E a floor under every point, α > 0
    p0 = [min(max(e0, 0.0), high[0] * (1 - 1e-9)), max(a0, 1e-9), alpha0]

    def model(xs, e, a, alpha):
        return e + a * np.power(xs, -alpha)

    try:
        with warnings.catch_warnings():  # 3 points: no covariance, which the intervals' None says
            warnings.simplefilter("ignore", optimize.OptimizeWarning)
            params, cov = optimize.curve_fit(model, x, y, p0=p0, bounds=(low, high), maxfev=20000)
    except (RuntimeError, optimize.OptimizeWarning):
        params, cov = np.array(p0), None
    e, a, alpha = (float(v) for v in params)
    residual = y - model(x, e, a, alpha)
    rmse = float(np.sqrt(np.mean(residual ** 2)))
    dof = len(pts) - N_PARAMS
    unit = scale ** alpha  # back to C's own units: A'·(C/s)^(−α) = (A'·s^α)·C^(−α)
    e_ci = a_ci = alpha_ci = None
    if dof > 0 and cov is not None and np.all(np.isfinite(cov)) and a > 0:
        t = stats.t.ppf(0.975, dof)
        sd = np.sqrt(np.clip(np.diag(cov), 0, None))
        e_ci, alpha_ci = (e - t * sd[0], e + t * sd[0]), (alpha - t * sd[2], alpha + t * sd[2])
        # log A = log A' + α·log s: A' and α are correlated, so the interval of A comes by the delta method
        ls = math.log(scale)
        var = cov[1, 1] / a ** 2 + ls ** 2 * cov[2, 2] + 2 * ls * cov[1, 2] / a
        half = t * math.sqrt(max(float(var), 0.0))
        log_a = math.log(a * unit)
        a_ci = tuple(math.exp(v) if v < 709 else math.inf for v in (log_a - half, log_a + half))  # 4 points: wide
    return PowerLaw(E=e, A=a * unit, alpha=alpha, n=len(pts), rmse=rmse, E_ci=e_ci, A_ci=a_ci, alpha_ci=alpha_ci,
                    scale=scale, cov=None if e_ci is None else tuple(map(tuple, np.asarray(cov).tolist())))


def compute_multiplier(variant: PowerLaw, baseline: PowerLaw, compute: float) -> float:
    """The compute the variant needs for the baseline's loss at `compute`, as a multiple of `compute`."""
    return variant.compute_for(float(baseline.loss(compute))) / compute


def crossover(variant: PowerLaw, baseline: PowerLaw, low: float, high: float) -> list[float]:
    """The computes in [low/1e6, high·1e6] where the two fits cross (sign changes of L_v − L_b on a log grid, each
    refined by Brent's method); empty when one stays below the other."""
    grid = np.logspace(math.log10(low) - 6, math.log10(high) + 6, 2000)
    diff = lambda lc: float(variant.loss(10.0 ** lc) - baseline.loss(10.0 ** lc))  # noqa: E731
    logs = np.log10(grid)
    values = [diff(lc) for lc in logs]
    roots = []
    for (l0, v0), (l1, v1) in zip(zip(logs, values), zip(logs[1:], values[1:])):
        if v0 == 0.0:
            roots.append(10.0 ** l0)
        elif v0 * v1 < 0:
            roots.append(10.0 ** optimize.brentq(diff, l0, l1))
    return roots


@dataclass(frozen=True)
class ChinchillaLaw:
    """L(N, D) = E + A/N^α + B/D^β, with 95% intervals (None where the points leave no degree of freedom)."""

    E: float
    A: float
    alpha: float
    B: float
    beta: float
    n: int
    rmse: float
    E_ci: tuple[float, float] | None = None
    A_ci: tuple[float, float] | None = None
    alpha_ci: tuple[float, float] | None = None
    B_ci: tuple[float, float] | None = None
    beta_ci: tuple[float, float] | None = None

    def loss(self, n: float | np.ndarray, d: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A * np.power(n, -self.alpha) + self.B * np.power(d, -self.beta)

    @property
    def n_opt_exponent(self) -> float:
        """a in N_opt ∝ C^a for C ≈ 6·N·D (Hoffmann et al.'s Eq. 4: a = β/(α+β); D_opt ∝ C^(1−a))."""
        return self.beta / (self.alpha + self.beta)


def varies_both(n: np.ndarray, d: np.ndarray) -> str | None:
    """Why points (n[i], d[i]) cannot separate N's term from D's (None: they can): one N, one D, or the points
    within COLLINEAR (rms, in log units) of one line in log N–log D."""
    ln, ld = np.log(n), np.log(d)
    for name, v, x in (("N", ln, n), ("D", ld, d)):
        if np.ptp(v) < COLLINEAR:
            return f"its runs have one {name} ({float(np.exp(np.mean(v))):.3g})"
    centred = np.stack([ln - ln.mean(), ld - ld.mean()], axis=1)
    off_line = np.linalg.svd(centred, compute_uv=False)[-1] / math.sqrt(len(n))  # rms distance from the best line
    if off_line < COLLINEAR:
        slope = float(np.polyfit(ln, ld, 1)[0])
        why = ("the tokens per parameter were fixed, e.g. budget.tokens_per_param" if slope > 0.5 else
               "one compute budget, e.g. budget.flops" if slope < -0.5 else "N and D moved together")
        return (f"its points lie along D ∝ N^{slope:.2f} (within {off_line:.2g} of a line in log N–log D: {why}); "
                f"train some sizes at several token counts (-m budget.tokens_per_param=5,10,20)")
    return None


def _linear_nd(x: np.ndarray, z: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    """(E, A, B) and the squared error of y ≈ E + A·x + B·z, least squares with 0 ≤ E ≤ min(y), A, B ≥ 0."""
    design = np.stack([np.ones_like(x), x, z], axis=1)
    sol = np.linalg.lstsq(design, y, rcond=None)[0]
    if not (0 <= sol[0] <= y.min() and sol[1] >= 0 and sol[2] >= 0):
        sol = optimize.lsq_linear(design, y, bounds=([0, 0, 0], [y.min(), np.inf, np.inf]), method="bvls").x
    return sol, float(np.sum((design @ sol - y) ** 2))


def _log_ci(value: float, var_log: float, t: float) -> tuple[float, float]:
    half = t * math.sqrt(max(float(var_log), 0.0))
    log_v = math.log(value)
    return tuple(math.exp(v) if v < 709 else math.inf for v in (log_v - half, log_v + half))


def fit_chinchilla(n_params: Sequence[float], tokens: Sequence[float], loss: Sequence[float]) -> ChinchillaLaw:
    """The fit of L(N, D) = E + A/N^α + B/D^β to the points (n_params[i], tokens[i], loss[i]); refuses fewer than 5
    usable points and a ladder that does not vary both N and D (varies_both)."""
    pts = [(float(a), float(b), float(v)) for a, b, v in zip(n_params, tokens, loss)
           if a and a > 0 and b and b > 0 and math.isfinite(v)]
    if len(pts) < ND_PARAMS:
        raise ValueError(f"a fit of L(N, D) = E + A/N^α + B/D^β has {ND_PARAMS} parameters and needs at least "
                         f"{ND_PARAMS} points (runs that finished with a val loss); got {len(pts)}")
    n, d, y = (np.array(col) for col in zip(*pts))
    if (why := varies_both(n, d)) is not None:
        raise ValueError(f"an L(N, D) fit needs a ladder that varies both N and D: {why}")
    sn, sd = float(np.exp(np.mean(np.log(n)))), float(np.exp(np.mean(np.log(d))))
    x, z = n / sn, d / sd
    best = min(((*_linear_nd(x ** -a, z ** -b, y), a, b) for a in ND_EXPONENTS for b in ND_EXPONENTS),
               key=lambda t: t[1])
    (e0, a0, b0), _, alpha0, beta0 = best
    low = [0.0, 0.0, ND_EXPONENTS[0] / 10, 0.0, ND_EXPONENTS[0] / 10]
    high = [float(y.min()), np.inf, 3.0, np.inf, 3.0]
    p0 = [min(max(e0, 0.0), high[0] * (1 - 1e-9)), max(a0, 1e-9), alpha0, max(b0, 1e-9), beta0]

    def model(xz, e, a, alpha, b, beta):
        return e + a * np.power(xz[0], -alpha) + b * np.power(xz[1], -beta)

    try:
        with warnings.catch_warnings():  # 5 points: no covariance, which the intervals' None says
            warnings.simplefilter("ignore", optimize.OptimizeWarning)
            params, cov = optimize.curve_fit(model, np.stack([x, z]), y, p0=p0, bounds=(low, high), maxfev=20000)
    except (RuntimeError, optimize.OptimizeWarning):
        params, cov = np.array(p0), None
    e, a, alpha, b, beta = (float(v) for v in params)
    rmse = float(np.sqrt(np.mean((y - model(np.stack([x, z]), *params)) ** 2)))
    dof = len(pts) - ND_PARAMS
    cis: dict[str, tuple[float, float] | None] = dict.fromkeys(("E_ci", "A_ci", "alpha_ci", "B_ci", "beta_ci"))
    if dof > 0 and cov is not None and np.all(np.isfinite(cov)) and a > 0 and b > 0:
        t = stats.t.ppf(0.975, dof)
        half = [float(v) for v in t * np.sqrt(np.clip(np.diag(cov), 0, None))]
        cis["E_ci"], cis["alpha_ci"] = (e - half[0], e + half[0]), (alpha - half[2], alpha + half[2])
        cis["beta_ci"] = (beta - half[4], beta + half[4])
        # log A = log A' + α·log s_N (and B alike): the delta method over the correlated pair
        ln_, ld_ = math.log(sn), math.log(sd)
        cis["A_ci"] = _log_ci(a * sn ** alpha, cov[1, 1] / a ** 2 + ln_ ** 2 * cov[2, 2] + 2 * ln_ * cov[1, 2] / a, t)
        cis["B_ci"] = _log_ci(b * sd ** beta, cov[3, 3] / b ** 2 + ld_ ** 2 * cov[4, 4] + 2 * ld_ * cov[3, 4] / b, t)
    return ChinchillaLaw(E=e, A=a * sn ** alpha, alpha=alpha, B=b * sd ** beta, beta=beta, n=len(pts), rmse=rmse,
                         **cis)
