"""Padded sizes for jitted calls: few distinct shapes (each compiles once), little padding."""

from __future__ import annotations


def pow2_at_least(n: int, floor: int = 1) -> int:
    b = floor
    while b < n:
        b *= 2
    return b


def table_width(pages: int, cap: int) -> int:
    """Block-table width for a call: few distinct shapes (each compiles once) yet little padding.

    Up to 8 pages: powers of two. Beyond: steps of 1/16 of the enclosing power of two; since
    pages > p2 / 2, at most 12.5% of the pages read are padding (<= 16 shapes per doubling).
    Capped at the longest sequence the engine allows.
    """
    p2 = pow2_at_least(pages)
    step = p2 if p2 <= 8 else max(1, p2 // 16)
    return min(-(-pages // step) * step, max(cap, pages))
