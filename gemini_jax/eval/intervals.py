"""95% intervals for the figures results report: a proportion of trials (Wilson score), the
difference of two proportions on the same trials (Newcombe's paired score interval) and a mean
over independent samples (Student t). Plain numpy: no statistics package needed."""

from __future__ import annotations

import math

import numpy as np

Z95 = 1.959963984540054
# Two-sided 95% Student t quantiles for 1 ... 30 degrees of freedom.
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def t95(df: int) -> float:
    """Two-sided 95% t quantile: the table to 30 degrees of freedom, then the Cornish-Fisher
    expansion (within 1e-3 of the exact quantile there)."""
    if df < 1:
        raise ValueError(f"df={df} must be >= 1.")
    if df <= len(_T95):
        return _T95[df - 1]
    z = Z95
    return z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)


def wilson(hits: int, n: int) -> tuple[float, float]:
    """95% Wilson score interval of a proportion hits / n (sane at 0 and n, unlike the normal one)."""
    if n <= 0 or not 0 <= hits <= n:
        raise ValueError(f"need 0 <= hits <= n and n > 0, got hits={hits}, n={n}.")
    p = hits / n
    den = 1 + Z95 ** 2 / n
    mid = (p + Z95 ** 2 / (2 * n)) / den
    half = Z95 * math.sqrt(p * (1 - p) / n + Z95 ** 2 / (4 * n * n)) / den
    return max(0.0, mid - half), min(1.0, mid + half)


def mean_t95(samples) -> tuple[float, float, float]:
    """(mean, low, high): the mean of independent samples with its 95% t interval (nan bounds
    for a single sample)."""
    x = np.asarray(samples, np.float64)
    m = float(x.mean())
    if len(x) < 2:
        return m, float("nan"), float("nan")
    half = t95(len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return m, m - half, m + half


def paired_difference(both: int, only_a: int, only_b: int, neither: int) -> tuple[float, float, float]:
    """(difference, low, high): p_a - p_b for two systems scored on the same trials, with the 95%
    interval of Newcombe (1998, method 10: Wilson intervals of each proportion combined with the
    correlation of the pairs). both / only_a / only_b / neither: trials right for both, for a only,
    for b only, for neither. Unlike a t interval on the per-trial differences it does not collapse
    to a point when no trial differs: 100 trials all alike still leave a few points either way."""
    n = both + only_a + only_b + neither
    if n <= 0 or min(both, only_a, only_b, neither) < 0:
        raise ValueError(f"need non-negative counts with a positive total, got {(both, only_a, only_b, neither)}.")
    pa, pb = (both + only_a) / n, (both + only_b) / n
    la, ua = wilson(both + only_a, n)
    lb, ub = wilson(both + only_b, n)
    den = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    phi = (both * neither - only_a * only_b) / math.sqrt(den) if den > 0 else 0.0
    d = pa - pb
    low = d - math.sqrt(max((pa - la) ** 2 - 2 * phi * (pa - la) * (ub - pb) + (ub - pb) ** 2, 0.0))
    high = d + math.sqrt(max((ua - pa) ** 2 - 2 * phi * (ua - pa) * (pb - lb) + (pb - lb) ** 2, 0.0))
    return d, max(-1.0, low), min(1.0, high)

