"""A sequence's KV taken off the page pool and put back: what a snapshot saves and what a
preempted request keeps in host memory while its pages serve others.

    image = images.take(kv, store, sid)        # tokens + every page's K, V (and digests), numpy
    kv.free(sid)                               # its pages go back to the pool
    images.restore(kv, store, sid, image)      # later: same tokens, same bytes, maybe other pages

NOTE: the bytes are copied, not recomputed, so a restored sequence decodes exactly as if it had
never left (docs/architecture.md §6: paging and tiering change where bytes live, never the numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from gemini_jax.attention import kvquant
from gemini_jax.cache.block_pool import NULL_PAGE
from gemini_jax.cache.shapes import pow2_at_least


@dataclass(frozen=True, eq=False)
class SequenceImage:
    """Tokens whose KV is written, which logical pages were dropped (sliding window), and the
    pages' contents: k, v [L, K, n, S, D], digests [L, K, n, R, D] or None (n = every logical page)."""

    tokens: tuple
    null_pages: tuple
    k: np.ndarray
    v: np.ndarray
    digests: Optional[np.ndarray] = None

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + (0 if self.digests is None else self.digests.nbytes)

    @property
    def num_pages(self) -> int:
        """Pages the sequence holds in the pool (dropped ones excluded)."""
        return self.k.shape[2] - len(self.null_pages)


def take(kv, store, sid: int) -> SequenceImage:
    """Copy sequence `sid`'s pages out of `store` (wherever each lives: device, host, disk)."""
    seq = kv.seqs[sid]
    pages = list(seq.pages)
    k, v, dig = store.gather(pages)
    return SequenceImage(tokens=tuple(int(t) for t in seq.tokens),
                         null_pages=tuple(i for i, p in enumerate(pages) if p == NULL_PAGE), k=k, v=v, digests=dig)


def restore(kv, store, sid: int, image: SequenceImage) -> None:
    """Register sequence `sid` with the image's tokens and write its pages (full pages still
    cached in the pool are shared, not rewritten). On CacheExhausted nothing changes."""
    tokens = list(image.tokens)
    to_fill = kv.restore_sequence(sid, tokens, set(image.null_pages))
    if not to_fill:
        return
    logical = np.asarray([i for i, _ in to_fill])
    phys = [p for _, p in to_fill]
    S = kv.block_size
    last = (len(tokens) - 1) // S  # the partial last page, if any, stays on device under tiers
    partial = [p for i, p in to_fill if i == last and len(tokens) % S]
    store.scatter(phys, image.k[:, :, logical], image.v[:, :, logical],
                  None if image.digests is None else image.digests[:, :, logical], partial=partial)


class Pow2Gather:
    """`store`'s page gather (what `images.take` calls) over a power-of-two count of pages: the
    null page fills the rest, cut off after. A pooled store compiles one gather per count, and a
    server swaps out sequences of every length, each new one stalling every live request for the
    compile (~0.2 s here); padded, the counts up to a pool's size take a handful of programs."""

    def __init__(self, store):
        self.store = store

    def gather(self, pages):
        n = len(pages)
        k, v, dig = self.store.gather(list(pages) + [NULL_PAGE] * (pow2_at_least(max(n, 1)) - n))
        # Copies: the image would otherwise keep the padding's memory alive while it waits.
        first = lambda x: x[:, :, :n].copy()  # noqa: E731
        if isinstance(k, kvquant.QuantPages):
            k, v = (kvquant.QuantPages(first(x.data), first(x.scale)) for x in (k, v))
        else:
            k, v = first(k), first(v)
        return k, v, None if dig is None else first(dig)
