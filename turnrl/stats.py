"""Honest-evaluation maths: confidence intervals and pass@k, as small pure functions.

A success rate from a few dozen episodes is noisy; every rate TurnRL reports carries an
interval so that "before vs after" comparisons can be judged rather than eyeballed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["format_rate", "mean_interval", "pass_at_k", "wilson_interval"]


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
    n = len(values)
    if n == 0:
        raise ValueError("mean_interval needs at least one value")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, mean, mean
    var = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    half = z * math.sqrt(var / n)
    return mean, mean - half, mean + half


def format_rate(successes: int, n: int) -> str:
    """Format a success rate with its 95% Wilson interval, e.g. ``23.4% [15.1, 34.2]``.

    With n == 0 there is no rate to show, so the point estimate reads ``n/a``.
    """
    lo, hi = wilson_interval(successes, n)
    point = f"{100.0 * successes / n:.1f}%" if n else "n/a"
    return f"{point} [{100.0 * lo:.1f}, {100.0 * hi:.1f}]"
