"""Side-by-side timing: every repeat runs every compared variant once, in a rotated order, so
background load on the shared machine lands on all of them; headlines are medians of per-repeat
ratios, never times from separate runs."""

from __future__ import annotations

import statistics
from typing import Callable

from tqdm import tqdm


def interleaved(variants: dict[str, Callable[[], float]], repeats: int, desc: str) -> dict[str, list[float]]:
    """Run each variant once per repeat; the order rotates every repeat.

    A variant is a callable that does its own setup and returns the seconds of the part being
    timed (e.g. decode only, prefill excluded). Returns name -> per-repeat seconds, index r of
    every list coming from the same repeat r.
    """
    names = list(variants)
    out = {n: [] for n in names}
    for r in tqdm(range(repeats), desc=desc, leave=False):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            out[n].append(float(variants[n]()))
    return out


def median(xs) -> float:
    return float(statistics.median(xs))


def ratio_stats(num: list[float], den: list[float]) -> dict:
    """Median, min and max of the per-repeat ratios num[r] / den[r] (same-repeat pairs)."""
    rs = [a / b for a, b in zip(num, den)]
    return {"ratio": median(rs), "ratio_min": min(rs), "ratio_max": max(rs)}


def fmt_ratio(s: dict, prefix: str = "") -> str:
    """'**1.23×** (1.10–1.40)' from the `ratio_stats` keys (optionally prefixed) in `s`."""
    r, lo, hi = s[prefix + "ratio"], s[prefix + "ratio_min"], s[prefix + "ratio_max"]
    return f"**{r:.2f}×** ({lo:.2f}–{hi:.2f})"


def md_table(headers: list[str], rows: list[list]) -> str:
    def line(cells):
        return "| " + " | ".join(str(c) for c in cells) + " |"

    return "\n".join([line(headers), line(["---"] * len(headers))] + [line(r) for r in rows])


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_ms(s: float) -> str:
    return f"{s * 1e3:.2f} ms"
