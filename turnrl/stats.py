"""Honest-evaluation maths: confidence intervals and pass@k, as small pure functions.

A success rate from a few dozen episodes is noisy; every rate TurnRL reports carries an
interval so that "before vs after" comparisons can be judged rather than eyeballed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["bootstrap_mean_interval", "format_rate", "mcnemar_exact", "mean_interval",
           "pass_at_k", "sign_flip_test", "student_t_quantile", "t_interval", "wilson_interval"]


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion.

    Preferred over the normal (Wald) interval because it stays inside [0, 1] and does not
    collapse to zero width at 0/n or n/n, which are common with small evaluation sets.
    With no trials nothing is known, so the interval is the whole of [0, 1].
    """
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got successes={successes}, n={n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # Clamp only against floating-point overshoot; mathematically the bounds are in [0, 1].
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k estimator 1 - C(n-c, k) / C(n, k) (Chen et al. 2021, the Codex paper).

    ``n`` samples were drawn, ``c`` of them correct. The ratio of binomials is computed as
    the product prod_{i=n-c+1}^{n} (1 - k / i), which avoids huge factorials.
    """
    if n < 0 or not 0 <= c <= n:
        raise ValueError(f"need 0 <= c <= n, got n={n}, c={c}")
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > n:
        raise ValueError(f"k={k} exceeds the number of samples n={n}")
    if n - c < k:
        # Every size-k subset must contain a correct sample.
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def mean_interval(values: Sequence[float], z: float = 1.96) -> tuple[float, float, float]:
    """Return (mean, lo, hi): the mean with a normal-approximation CI, z * s / sqrt(n).

    ``s`` is the sample (n-1) standard deviation. One value gives a zero-width interval
    because its spread cannot be estimated; an empty sequence is an error.
    """
    mean, sem = _mean_and_standard_error(values, "mean_interval")
    return mean, mean - z * sem, mean + z * sem


def _mean_and_standard_error(values: Sequence[float], caller: str) -> tuple[float, float]:
    """(mean, s / sqrt(n)) with the sample (n-1) deviation; 0 for one value."""
    n = len(values)
    if n == 0:
        raise ValueError(f"{caller} needs at least one value")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, 0.0
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1) / n)


def format_rate(successes: int, n: int) -> str:
    """Format a success rate with its 95% Wilson interval, e.g. ``23.4% [15.1, 34.2]``.

    With n == 0 there is no rate to show, so the point estimate reads ``n/a``.
    """
    lo, hi = wilson_interval(successes, n)
    point = f"{100.0 * successes / n:.1f}%" if n else "n/a"
    return f"{point} [{100.0 * lo:.1f}, {100.0 * hi:.1f}]"


def bootstrap_mean_interval(values: Sequence[float], *, resamples: int = 2000, level: float = 0.95,
                            seed: int = 0) -> tuple[float, float, float]:
    """Return (mean, lo, hi): the mean with a percentile bootstrap interval (Efron 1979).

    Used for per-task quantities (a task's pass@k estimate, its success rate over several
    samples, a paired difference): resampling *tasks* keeps a task's samples together, so
    the interval reflects that samples of one task are correlated, which a Wilson interval
    over all episodes would ignore. Seeded, so the same data gives the same interval.
    """
    data = np.asarray(values, dtype=np.float64)
    if data.size == 0:
        raise ValueError("bootstrap_mean_interval needs at least one value")
    rng = np.random.default_rng(seed)
    means = data[rng.integers(0, data.size, size=(resamples, data.size))].mean(axis=1)
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(means, [tail, 1.0 - tail])
    return float(data.mean()), float(lo), float(hi)


def _t_two_sided_mass(t: float, df: int) -> float:
    """P(|T| < t) for Student's t with integer ``df``, by the finite series of Abramowitz and
    Stegun 26.7.3-4 (no special functions needed)."""
    theta = math.atan(t / math.sqrt(df))
    c2, s = math.cos(theta) ** 2, math.sin(theta)
    if df % 2:  # odd: 2/pi * (theta + sin cos * (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...))
        term, series = 1.0, 1.0 if df > 1 else 0.0
        for j in range(1, (df - 1) // 2):
            term *= c2 * (2 * j) / (2 * j + 1)
            series += term
        return 2.0 / math.pi * (theta + s * math.cos(theta) * series)
    term, series = 1.0, 1.0  # even: sin * (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
    for j in range(1, df // 2):
        term *= c2 * (2 * j - 1) / (2 * j)
        series += term
    return s * series


def student_t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile (0.5 < p < 1) of Student's t with integer ``df``, by bisection."""
    if not 0.5 < p < 1.0 or df < 1:
        raise ValueError(f"need 0.5 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = 0.0, 1.0
    while _t_two_sided_mass(hi, df) < 2 * p - 1:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if _t_two_sided_mass(mid, df) < 2 * p - 1 else (lo, mid)
    return (lo + hi) / 2.0


def t_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
    """Return (mean, lo, hi): the Student t interval mean +- t_{n-1} * s / sqrt(n).

    For a handful of independent runs (training seeds) of one config: with n this small
    the normal quantile 1.96 would be far too narrow (t_{0.975, 2} = 4.30 for 3 seeds).
    One value gives a zero-width interval: its spread cannot be estimated.
    """
    mean, sem = _mean_and_standard_error(values, "t_interval")
    if len(values) == 1:
        return mean, mean, mean
    half = student_t_quantile(0.5 + level / 2.0, len(values) - 1) * sem
    return mean, mean - half, mean + half


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided p-value of McNemar's exact test (McNemar 1947) for paired binary outcomes.

    ``only_a``: pairs where A succeeded and B failed; ``only_b``: the reverse. Under the
    null (A and B equally good) each discordant pair goes either way with probability 1/2,
    so the smaller count is Binomial(only_a + only_b, 1/2); p = 2 * P(X <= min), capped at 1.
    Computed with exact integers, so large counts do not underflow; each binomial
    coefficient from the one before (C(m, i+1) = C(m, i) (m-i) / (i+1)), where computing each
    afresh made the tail quadratic in ``m`` (4096 discordant pairs: 0.7 s, now 0.002 s).
    """
    if only_a < 0 or only_b < 0:
        raise ValueError(f"counts must be >= 0, got {only_a}, {only_b}")
    m = only_a + only_b
    if m == 0:
        return 1.0
    term = tail = 1
    for i in range(min(only_a, only_b)):
        term = term * (m - i) // (i + 1)
        tail += term
    return min(1.0, 2 * tail / 2**m)


def sign_flip_test(differences: Sequence[float], *, resamples: int = 10000,
                   seed: int = 0) -> float:
    """Two-sided p-value of the paired sign-flip permutation test of a zero mean difference.

    Under the null that A and B are exchangeable within a pair (a task), each per-task
    difference is as likely to have the opposite sign. The statistic is |sum of
    differences|; the p-value counts sign assignments at least as extreme: all of them when
    there are at most 16 non-zero differences, else ``resamples`` random ones (with the
    observed assignment counted, so p > 0). For 0/1 outcomes with one sample per task the
    differences are -1/0/+1 and the exact test is McNemar's exact test.
    """
    d = np.asarray([x for x in differences if x != 0], dtype=np.float64)
    if d.size == 0:
        return 1.0
    observed = abs(d.sum()) - 1e-9 * max(1.0, abs(d).sum())  # tolerate rounding in ties
    if d.size <= 16:
        signs = ((np.arange(2**d.size)[:, None] >> np.arange(d.size)) & 1) * 2 - 1
        return float(np.mean(np.abs(signs @ d) >= observed))
    rng = np.random.default_rng(seed)
    signs = np.where(rng.random((resamples, d.size)) < 0.5, -1.0, 1.0)
    return float((np.sum(np.abs(signs @ d) >= observed) + 1) / (resamples + 1))
