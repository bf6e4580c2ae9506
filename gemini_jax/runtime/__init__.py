"""Runners: what runs a batch of sequences through the model over a KV store.

    runner = make_runner(ctx, batch, stats)   # contiguous, paged or tiered, by the store
    logits = runner.prefill(row, prompt)      # then runner.decode(tokens, lengths), runner.close()

All runners share the chunking of prompts (`chunking`), the per-call boundary types (`batch`),
the counters (`counters`) and, over the page pool, one layer body (`attention.pool.write_layer`,
`attention.select.select_step`, `attention.sparse.sparse_attention`).
"""

from gemini_jax.runtime.aligned import AlignedRunner
from gemini_jax.runtime.context import RunContext
from gemini_jax.runtime.contiguous import ContiguousRunner
from gemini_jax.runtime.counters import COUNTERS, Counters, new_stats
from gemini_jax.runtime.paged import PooledRunner
from gemini_jax.runtime.tiered import TieredRunner


def make_runner(ctx: RunContext, batch: int, stats: Counters):
    """The runner for the engine's cache: contiguous (no store), paged (syntax-aligned or not), or tiered."""
    if ctx.store is None:
        return ContiguousRunner(ctx, batch, stats)
    if ctx.store.layerwise:
        return TieredRunner(ctx, batch, stats)
    if ctx.config.cache.align != "none":
        return AlignedRunner(ctx, batch, stats)
    return PooledRunner(ctx, batch, stats)


__all__ = ["AlignedRunner", "COUNTERS", "Counters", "ContiguousRunner", "PooledRunner", "RunContext", "TieredRunner", "make_runner", "new_stats"]
