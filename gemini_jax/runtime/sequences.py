"""`SequenceCache`: the engine's sequences as callers outside the runtime see them.

Sessions, the serving scheduler, snapshots and benchmarks hold sequences in the engine's page
pool. They ask this object, never the page manager or the KV store underneath, so the two halves
of a sequence (host page bookkeeping in `cache.manager`, device bytes in the store) always move
together:

    seqs = engine.sequences
    sid = seqs.new_id()
    seqs.free_pages, seqs.pages_to_write(sid, end)   # planning: what a step would allocate
    image = seqs.swap_out(sid); seqs.release(sid)    # preemption by swap ...
    seqs.swap_in(sid, image)                         # ... and back: same tokens, same bytes
    seqs.truncate(sid, keep)                         # rewind (copy-on-write of a shared partial page)

The store's capabilities are read here (`pads_rows`), so callers never test the store's class.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax.attention import digests as page_digests
from gemini_jax.attention.views import Span
from gemini_jax.runtime import images, prefixes
from gemini_jax.runtime.context import RunContext


class SequenceCache:
    """Over one engine's `RunContext` (paged caches only); owns no state of its own."""

    def __init__(self, ctx: RunContext):
        self._ctx = ctx
        self._pages = ctx.pages
        self._store = ctx.store

    # ---- capacity -----------------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self._pages.block_size

    @property
    def capacity_pages(self) -> int:
        """Pages the pool can ever give one sequence (the null page excluded)."""
        return self._pages.pool.num_pages - 1

    @property
    def free_pages(self) -> int:
        """Pages allocatable now (pages still caching a prefix count as free)."""
        return self._pages.pool.num_free

    def can_admit(self, pages: int) -> bool:
        return self._pages.can_admit(pages)

    def usage(self) -> dict:
        """Pool occupancy (`KVCacheManager.usage`)."""
        return self._pages.usage()

    @property
    def pads_rows(self) -> bool:
        """Whether a decode batch may carry padding rows of a scratch sequence (a store that keeps
        one device row per sequence, the tiered one, cannot)."""
        return self._store.supports_padding

    # ---- one sequence -------------------------------------------------------------------------
    def new_id(self) -> int:
        """A sequence id unique over the engine's life."""
        return self._ctx.new_ids(1)[0]

    def has(self, sid: int) -> bool:
        return sid in self._pages.seqs

    def num_tokens(self, sid: int) -> int:
        """Tokens whose KV is written (0 for a sequence not in the pool)."""
        seq = self._pages.seqs.get(sid)
        return 0 if seq is None else seq.num_tokens

    def tokens(self, sid: int) -> list[int]:
        seq = self._pages.seqs.get(sid)
        return [] if seq is None else list(seq.tokens)

    def pages_to_write(self, sid: int, end: int) -> int:
        """New pages `sid` needs to hold positions up to `end`."""
        return self._pages.pages_to_write(sid, end)

    def allocate_slots(self, sid: int, n: int):
        """Pages for `n` more tokens of `sid` (`KVCacheManager.allocate_slots`): a list, or None
        with nothing changed when the pool cannot give them."""
        return self._pages.allocate_slots(sid, n)

    def open_scratch(self, tokens: int = 1) -> int:
        """A new empty sequence holding pages for `tokens` (padding rows of a decode batch); release it after."""
        sid = self.new_id()
        self._pages.add_sequence(sid, [])
        self._pages.reserve(sid, tokens)
        return sid

    def truncate(self, sid: int, keep: int) -> int:
        """Keep the first `keep` tokens of `sid` (a shared partial page is copied first); returns
        how many pages were copied."""
        copies = self._pages.truncate(sid, keep)
        if copies:
            self._store.copy_pages([c.src for c in copies], [c.dst for c in copies])
        return len(copies)

    def release_unwritten(self, sid: int) -> int:
        """Give back pages reserved past the last written token (tokens computed ahead, dropped)."""
        return self._pages.release_unwritten(sid)

    def release(self, sid: int) -> None:
        """Its pages go back to the pool (full ones stay cached for prefix reuse)."""
        self._pages.free(sid)

    def swap_out(self, sid: int) -> images.SequenceImage:
        """A copy of `sid`'s tokens and page bytes in host memory (the sequence stays; release it
        to free its pages). Gathers in power-of-two page counts (`images.Pow2Gather`)."""
        return images.take(self._pages, images.Pow2Gather(self._store), sid)

    def image(self, sid: int) -> images.SequenceImage:
        """`swap_out` with the store's exact-count gather (what a snapshot saves)."""
        return images.take(self._pages, self._store, sid)

    def swap_in(self, sid: int, image: images.SequenceImage) -> None:
        """Register `sid` with the image's tokens and bytes; on CacheExhausted nothing changes."""
        images.restore(self._pages, self._store, sid, image)

    def persist_prefix(self, sid: int) -> int:
        """Store `sid`'s full pages in the persistent prefix store (`tier.persistent`); how many."""
        return prefixes.persist(self._ctx, sid)

    # ---- sequences written from outside (benchmark harnesses, imported KV) ---------------------
    def write(self, sid: int, tokens, k, v) -> None:
        """Register new sequence `sid` holding `tokens` whose KV is given, k, v [L, K, n, S, D]
        (n = its pages, in the cache's dtype or float), as a prefill would leave it. With sparse
        attention the pages' digests are computed from `k` by the same per-layer update a prefill
        of the whole sequence makes (`digests.update`). On CacheExhausted nothing changes."""
        tokens = np.asarray(tokens, np.int32)
        self._pages.add_sequence(sid, [])
        try:
            self._pages.reserve(sid, len(tokens))
        except BaseException:
            self._pages.free(sid)
            raise
        self._pages.commit(sid, tokens)
        pages = list(self._pages.seqs[sid].pages)
        self._store.scatter(pages, k, v)
        if self._store.device.digests is not None:
            self._update_digests(np.asarray(pages, np.int32), len(tokens))

    def _update_digests(self, pages: np.ndarray, n: int) -> None:
        kind = self._ctx.config.sparse.digest
        table = jnp.asarray(pages[None])
        span = Span(jnp.arange(n, dtype=jnp.int32)[None], jnp.asarray([n], jnp.int32), table)
        upd = jax.jit(page_digests.update, static_argnums=0, donate_argnums=1)
        for layer in range(self._ctx.model_cfg.num_layers):  # one layer at a time: bounded temporaries
            self._store.update(lambda kv, layer=layer: (kv._replace(digests=upd(kind, kv.digests, kv.k, layer, span)),
                                                        None))
        jax.block_until_ready(self._store.device.digests)

    def gather_pages(self, sid: int, logical) -> images.SequenceImage:
        """The bytes of `sid`'s logical pages `logical` (k, v and digests [L, K, len(logical), ...])."""
        pages = [self._pages.seqs[sid].pages[i] for i in logical]
        k, v, dig = self._store.gather(pages)
        return images.SequenceImage(tokens=(), null_pages=(), k=k, v=v, digests=dig)

    def num_pages(self, sid: int) -> int:
        """Logical pages `sid` holds (reserved ones included)."""
        return len(self._pages.seqs[sid].pages)

    def block_tables(self, sids, width: int) -> np.ndarray:
        """i32[len(sids), width]: each sequence's page ids, padded with the null page."""
        return self._pages.block_tables(sids, width)

    @property
    def device_digests(self):
        """The pool's page digests as the next step reads them (None without sparse attention);
        read them at call time: a step replaces the array."""
        return self._store.device.digests
