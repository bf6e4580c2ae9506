"""The contiguous dense reference: a fresh [B, max_seq_len] cache per batch of prompts."""

from __future__ import annotations

import jax.numpy as jnp

from gemini_jax.cache import ContiguousKV
from gemini_jax.runtime.chunking import prefill_pieces
from gemini_jax.runtime.context import RunContext
from gemini_jax.runtime.counters import Counters, count_prefill


class ContiguousRunner:
    def __init__(self, ctx: RunContext, batch: int, stats: Counters):
        self.ctx, self.stats, self.batch = ctx, stats, batch
        self.cache = ContiguousKV.create(ctx.model_cfg, batch, ctx.config.max_seq_len, ctx.cache_dtype)

    def prefill(self, row, toks):
        ctx = self.ctx
        logits = None
        for padded, pos, n in prefill_pieces(ctx.config, toks, 0):
            logits, self.cache = ctx.step(ctx.params, self.cache._replace(rows=jnp.asarray([row], jnp.int32)),
                                          jnp.asarray(padded[None]), jnp.asarray(pos[None]),
                                          jnp.asarray([n - 1], jnp.int32))
            count_prefill(self.stats, ctx.model_cfg, n)
        return logits

    def decode(self, nxt, lengths):
        ctx = self.ctx
        logits, self.cache = ctx.step(ctx.params, self.cache._replace(rows=jnp.arange(self.batch, dtype=jnp.int32)),
                                      jnp.asarray(nxt[:, None]), jnp.asarray(lengths[:, None]),
                                      jnp.zeros(self.batch, jnp.int32))
        self.stats.kv_bytes_read += self.cache.bytes_per_read(self.batch)
        return logits

    def close(self):
        self.cache = None
