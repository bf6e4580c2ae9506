"""Things several rows share."""

from __future__ import annotations

import gc
import resource

from gemini_jax.bench.models import BenchModel, build_llama, build_llama_jax
from gemini_jax.bench.registry import Context


def llama(ctx: Context) -> BenchModel:
    """The benchmark Llama (built once per run, shared by every row)."""
    return ctx.shared("llama", lambda: build_llama(ctx.seed))


def llama_weights(ctx: Context) -> BenchModel:
    """The benchmark Llama for rows that time our engine alone: the transformers-built one when
    torch is here (the same weights as the other rows), else the same shape built by gemini_jax."""
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return ctx.shared("llama_jax", lambda: build_llama_jax(ctx.seed))
    return llama(ctx)


def peak_rss_gib() -> float:
    """Peak resident set of this process so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def close_harnesses(*hs) -> None:
    """Close decode harnesses (None skipped) and collect, so their page pools are freed now."""
    for h in hs:
        if h is not None:
            h.close()
    gc.collect()
