"""The contiguous dense reference: a fresh [B, max_seq_len] cache per batch of prompts."""

from __future__ import annotations

import functools

import jax.numpy as jnp

from gemini_jax.cache import ContiguousKV
from gemini_jax.runtime import soft
from gemini_jax.runtime.chunking import prefill_pieces
from gemini_jax.runtime.context import RunContext
from gemini_jax.runtime.counters import Counters, count_prefill
from gemini_jax.runtime.multistep import HostOut, LoopInputs, LoopSpec, decode_loop, fetch


class ContiguousRunner:
    multistep = True  # decode_many: several decode steps per program

    def __init__(self, ctx: RunContext, batch: int, stats: Counters):
        self.ctx, self.stats, self.batch = ctx, stats, batch
        self.cache = ContiguousKV.create(ctx.model_cfg, batch, ctx.config.max_seq_len, ctx.cache_dtype)

    def prefill(self, row, toks):
        ctx = self.ctx
        logits = None
        for padded, pos, n in prefill_pieces(ctx.config, toks, 0):
            embeds = soft.model_input(ctx, padded[None])  # None unless the chunk holds soft tokens
            logits, self.cache = ctx.step(ctx.params, self.cache._replace(rows=jnp.asarray([row], jnp.int32)),
                                          jnp.asarray(padded[None]) if embeds is None else embeds,
                                          jnp.asarray(pos[None]), jnp.asarray([n - 1], jnp.int32))
            count_prefill(self.stats, ctx.model_cfg, n)
        return logits

    def decode(self, nxt, lengths):
        ctx = self.ctx
        logits, self.cache = ctx.step(ctx.params, self.cache._replace(rows=jnp.arange(self.batch, dtype=jnp.int32)),
                                      jnp.asarray(nxt[:, None]), jnp.asarray(lengths[:, None]),
                                      jnp.zeros(self.batch, jnp.int32))
        self.stats.kv_bytes_read += self.cache.bytes_per_read(self.batch)
        return logits

    def decode_many(self, inp: LoopInputs, spec: LoopSpec, *, commit: bool = True) -> HostOut:
        """Up to `inp.n` decode steps in one program (`runtime.multistep`). The buffer is
        positional: nothing to commit (`commit` is accepted for the runner interface)."""
        ctx = self.ctx
        run = ctx.program(("contiguous", spec), lambda: decode_loop(functools.partial(_contiguous_step, ctx.forward),
                                                                    spec, ctx.model_cfg.vocab_size))
        self.cache, out = run(ctx.params, self.cache._replace(rows=jnp.arange(self.batch, dtype=jnp.int32)), None, inp)
        out = fetch(out)
        self.stats.kv_bytes_read += self.cache.bytes_per_read(self.batch) * out.steps
        return out

    def close(self):
        self.cache = None


def _contiguous_step(forward, params, cache: ContiguousKV, _, tok, pos):
    """One decode token per row (a `decode_loop` step); rows are the batch rows."""
    logits, cache = forward(params, cache, tok[:, None], pos[:, None], jnp.zeros_like(tok))
    zero = jnp.zeros((), jnp.int32)
    return logits, cache, (zero, zero)
