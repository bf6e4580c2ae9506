"""95% intervals for the figures results report: a proportion of trials (Wilson score) and a
mean over independent samples (Student t). Plain numpy: no statistics package needed."""

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
