"""Things several rows share."""

from __future__ import annotations

import gc
import resource

from benchlib.models import BenchModel, build_llama
from benchlib.registry import Context


def llama(ctx: Context) -> BenchModel:
    """The benchmark Llama (built once per run, shared by every row)."""
    return ctx.shared("llama", lambda: build_llama(ctx.seed))


def peak_rss_gib() -> float:
    """Peak resident set of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def close_harnesses(*hs) -> None:
    """Close decode harnesses (None skipped) and collect, so their page pools are freed now."""
    for h in hs:
        if h is not None:
            h.close()
    gc.collect()
