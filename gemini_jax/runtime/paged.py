"""Runners over the page pool: `SequenceRunner` holds what every paged runner does (sequences in the
page manager, prefill in chunks, decode steps, counters); `PooledRunner` runs each call as one
jitted whole-model step over the all-resident pool (`PooledStore`)."""

from __future__ import annotations

import abc
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax import distributed
from gemini_jax.attention import kvquant
from gemini_jax.attention.pool import PagedKV
from gemini_jax.cache.store import DeviceKV
from gemini_jax.runtime import prefixes, soft
from gemini_jax.runtime.batch import StepBatch
from gemini_jax.runtime.chunking import call_width, prefill_pieces
from gemini_jax.runtime.context import RunContext
from gemini_jax.runtime.counters import Counters, DecodeReads, count_decode_reads, count_prefill
from gemini_jax.runtime.multistep import HostOut, LoopInputs, LoopSpec, decode_loop, fetch


class SequenceRunner(abc.ABC):
    """Sequences of one batch in the engine's page manager; freed on close (their full pages stay
    cached for prefix reuse until reallocated). A subclass supplies `_call(batch) -> (logits,
    (page_reads, key_reads, table_width))` and may extend `_reserve`; one that can run several
    decode steps per program (`decode_many`) sets `multistep`."""

    multistep = False

    def __init__(self, ctx: RunContext, batch: int, stats: Counters):
        self.ctx, self.stats = ctx, stats
        self.ids = ctx.new_ids(batch)
        self.window = ctx.model_cfg.max_window

    # ---- the runner interface -----------------------------------------------------------------
    def add(self, sid, toks) -> int:
        """Register sequence `sid` with prompt `toks`, sharing cached prefix pages (and, with
        tier.persistent, pages an earlier engine stored); returns how many prompt tokens already
        have their KV (a multiple of block_size; the last token is always left to compute)."""
        reused = self.ctx.pages.add_sequence(sid, toks)
        reused += prefixes.load(self.ctx, sid, toks, reused)  # tier.persistent: pages of earlier engines
        self.stats.prefill_tokens_reused += reused
        return reused

    def prefill(self, row, toks):
        """Add sequence `row` with prompt `toks` (reusing cached prefix pages); last logits."""
        sid = self.ids[row]
        reused = self.add(sid, toks)
        logits = self._prefill_from(sid, np.asarray(toks, np.int32), reused)
        prefixes.persist(self.ctx, sid)
        return logits

    def prefill_more(self, row, toks):
        """Append `toks` to sequence `row` (an instruction after an interrupt); last logits."""
        sid = self.ids[row]
        have = np.asarray(self.ctx.pages.seqs[sid].tokens, np.int32)
        return self._prefill_from(sid, np.concatenate([have, np.asarray(toks, np.int32)]), len(have))

    def prefill_piece(self, sid, padded, positions, n):
        """One prefill chunk of sequence `sid` (a `chunking.prefill_pieces` item: `n` real tokens
        of `padded` at `positions`); its last real token's logits f32[1, V]."""
        ctx = self.ctx
        batch = self._piece_batch(sid, padded, positions, n)
        self._reserve(sid, int(batch.ends[0]))
        logits, _ = self._call(batch)
        ctx.pages.commit(sid, padded[:n])
        ctx.pages.drop_outside_window(sid, self.window)
        count_prefill(self.stats, ctx.model_cfg, n)
        return logits

    def decode(self, nxt, lengths, ids=None, *, pad: int = 0):
        """One token per sequence (`nxt` i32[B]) at positions `lengths` i32[B]; next logits.
        `ids`: which sequences (default: the runner's own, in order). `pad`: the last `pad` rows
        only fill the batch to a compiled shape (their tokens are not committed, their reads are
        counted: the device did them)."""
        ids = self.ids if ids is None else list(ids)
        batch = self._decode_batch(ids, nxt, lengths)
        for sid, n in zip(ids, batch.starts):
            self._reserve(sid, int(n) + 1)
        logits, (page_reads, key_reads, width) = self._call(batch)
        real = len(ids) - pad
        self.commit(np.asarray(nxt, np.int32)[:real, None], ids[:real])
        self._count(int(page_reads), int(key_reads), width, 1, len(ids))
        return logits

    def commit(self, written, ids=None) -> None:
        """Record tokens written after each row's end (i32[B, n]), dropping pages outside the window.
        `ids`: the rows' sequences (default: the runner's own)."""
        for sid, toks in zip(self.ids if ids is None else ids, written):
            self.ctx.pages.commit(sid, toks)
            self.ctx.pages.drop_outside_window(sid, self.window)

    def _count(self, page_reads: int, key_reads: int, width: int, steps: int, batch: int | None = None) -> None:
        ctx = self.ctx
        count_decode_reads(self.stats, ctx.config, ctx.model_cfg, DecodeReads(
            page_reads=page_reads, key_reads=key_reads, batch=len(self.ids) if batch is None else batch,
            table_width=width, steps=steps,
            kv_vector_bytes=kvquant.vector_bytes(ctx.cache_dtype, ctx.model_cfg.head_dim), digest_itemsize=ctx.store.digest_itemsize))

    def close(self):
        for sid in self.ids:
            if sid in self.ctx.pages.seqs:
                self.ctx.pages.free(sid)

    # ---- shared steps ---------------------------------------------------------------------------
    def _prefill_from(self, sid, toks, start):
        logits = None
        for padded, pos, n in prefill_pieces(self.ctx.config, toks, start):
            logits = self.prefill_piece(sid, padded, pos, n)
        return logits

    def _reserve(self, sid, total):
        self.ctx.pages.reserve(sid, total)

    def _piece_batch(self, sid, padded, positions, n) -> StepBatch:
        """The call of one prefill piece (`prefill_piece`)."""
        return StepBatch.prefill(sid, padded, positions, n)

    def _decode_batch(self, ids, nxt, lengths) -> StepBatch:
        """The call of one decode step (`decode`)."""
        return StepBatch.decode_step(ids, nxt, lengths)

    @abc.abstractmethod
    def _call(self, batch: StepBatch):
        """Run one call; -> (logits f32[B, V], (page_reads, key_reads, table_width))."""


class PooledRunner(SequenceRunner):
    """Each call is one jitted whole-model step over the all-resident pool."""

    def _call(self, batch: StepBatch):
        ctx = self.ctx
        width = call_width(ctx.config, ctx.pages, batch.ids, batch.width)
        tables = jnp.asarray(ctx.pages.block_tables(batch.ids, width))
        ends = jnp.asarray(batch.ends, jnp.int32)
        embeds = soft.model_input(ctx, batch.tokens)  # None unless the call holds soft tokens
        tokens = jnp.asarray(batch.tokens) if embeds is None else embeds
        positions = jnp.asarray(batch.positions)
        if ctx.mesh is not None:  # the batch goes over the mesh's data axis (when it divides)
            tokens = jax.device_put(tokens, distributed.batch_sharding(ctx.mesh, batch.batch, tokens.ndim))
            positions = jax.device_put(positions, distributed.batch_sharding(ctx.mesh, batch.batch, 2))
        select = jnp.asarray(batch.select, jnp.int32)
        # Syntax-aligned pages (runtime.aligned): positions are slots; rope and fills come with them.
        fill = None if batch.fill is None else jnp.asarray(batch.fill[:, :width])
        rope = None if batch.rope is None else jnp.asarray(batch.rope)

        def step(kv: DeviceKV):
            # Two counters, two buffers: the step donates its cache, and a buffer is donated once.
            cache = PagedKV(kv.k, kv.v, tables, ends, kv.digests, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),
                            fill)
            logits, cache = ctx.step(ctx.params, cache, tokens, positions, select, rope)
            # Device scalars: read (synced) by decode only.
            return DeviceKV(cache.k, cache.v, cache.digests), (logits, (cache.page_reads, cache.key_reads, width))

        return ctx.store.update(step)

    multistep = True

    def decode_many(self, inp: LoopInputs, spec: LoopSpec, *, commit: bool = True, ids=None,
                    pad: int = 0) -> HostOut:
        """Up to `inp.n` decode steps in one program (`runtime.multistep`): pages for all of them
        reserved first, the written tokens committed after (`commit=False`: left to the caller,
        which commits what it keeps; the rest is overwritten by the next write). `ids` and `pad`
        as in `decode` (pad rows: their tokens are not committed)."""
        ctx = self.ctx
        ids = self.ids if ids is None else list(ids)
        for sid, n0 in zip(ids, np.asarray(inp.lengths)):
            self._reserve(sid, int(n0) + int(inp.n))
        width = call_width(ctx.config, ctx.pages, ids, 1)
        tables = jnp.asarray(ctx.pages.block_tables(ids, width))
        run = ctx.program(("paged", spec), lambda: decode_loop(functools.partial(_paged_step, ctx.forward), spec,
                                                                ctx.model_cfg.vocab_size))
        out = fetch(ctx.store.update(lambda kv: run(ctx.params, kv, tables, inp)))
        if commit:
            real = len(ids) - pad
            self.commit(out.written(inp.tok)[:real], ids[:real])
        self._count(out.page_reads, out.key_reads, width, out.steps, len(ids))
        return out


def _paged_step(forward, params, kv: DeviceKV, tables, tok, pos):
    """One decode token per row over the pool (a `decode_loop` step)."""
    zero = jnp.zeros((), jnp.int32)
    cache = PagedKV(kv.k, kv.v, tables, pos + 1, kv.digests, zero, zero)
    logits, cache = forward(params, cache, tok[:, None], pos[:, None], jnp.zeros_like(tok))
    return logits, DeviceKV(cache.k, cache.v, cache.digests), (cache.page_reads, cache.key_reads)
