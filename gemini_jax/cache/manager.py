"""`KVCacheManager`: per-sequence block tables over a shared `BlockPool`, prefix reuse, fork.

NOTE: block tables are append-only. Logical page i of a sequence holds its positions
[i * block_size, (i + 1) * block_size). A full page is never written again, which is what makes
sharing it (prefix reuse, fork) safe; the one partial page is copied on fork.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from gemini_jax.cache.block_pool import NULL_PAGE, BlockPool
from gemini_jax.errors import CacheExhausted


def block_hash(prev: int, tokens) -> int:
    """Chained hash of one full block: depends on every token before it, not just its own."""
    h = hashlib.blake2b(digest_size=8)
    h.update(int(prev).to_bytes(8, "little", signed=False))
    h.update(np.asarray(tokens, np.int64).tobytes())
    return int.from_bytes(h.digest(), "little")


@dataclass
class SequenceKV:
    """Host state of one sequence's KV: which page holds which positions."""

    pages: list[int] = field(default_factory=list)  # NULL_PAGE where a page was dropped (window)
    tokens: list[int] = field(default_factory=list)  # ids whose KV is written, in order
    hashes: list[int] = field(default_factory=list)  # chained hashes of the full pages

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(frozen=True)
class PageCopy:
    """A device-side copy the caller must perform (copy-on-write of a partial page)."""

    src: int
    dst: int


class KVCacheManager:
    def __init__(self, num_pages: int, block_size: int, *, prefix_caching: bool = True):
        self.pool = BlockPool(num_pages)
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.seqs: dict[int, SequenceKV] = {}

    # ---- sequences --------------------------------------------------------------------------
    def add_sequence(self, seq_id: int, prompt) -> int:
        """Register a new sequence; share the longest cached run of its prompt's full pages.

        Returns how many prompt tokens are already in the cache (a multiple of block_size). At
        least the last prompt token is always left to compute: its logits are needed.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already exists.")
        seq = SequenceKV()
        self.seqs[seq_id] = seq
        if not self.prefix_caching:
            return 0
        S = self.block_size
        prev = 0
        for i in range((len(prompt) - 1) // S):
            h = block_hash(prev, prompt[i * S:(i + 1) * S])
            page = self.pool.cached(h)
            if page is None:
                break
            self.pool.acquire(page)
            seq.pages.append(page)
            seq.hashes.append(h)
            seq.tokens.extend(int(t) for t in prompt[i * S:(i + 1) * S])
            prev = h
        return seq.num_tokens

    def extend_cached(self, seq_id: int, tokens, hashes) -> list[int]:
        """Append full pages whose KV comes from elsewhere (a persistent prefix store): fresh pages
        for blocks `hashes` holding `tokens` (len(hashes) x block_size), registered for prefix
        reuse. The sequence must end on a page boundary. Returns the pages, whose data the caller
        writes. On CacheExhausted nothing changes."""
        seq = self.seqs[seq_id]
        S = self.block_size
        if seq.num_tokens != len(seq.pages) * S or len(tokens) != len(hashes) * S:
            raise ValueError(f"sequence {seq_id}: extend_cached needs whole pages ({seq.num_tokens} tokens in "
                             f"{len(seq.pages)} pages; {len(tokens)} tokens for {len(hashes)} blocks).")
        got = []
        try:
            for _ in hashes:
                got.append(self.pool.allocate())
        except CacheExhausted:
            for p in got:
                self.pool.release(p)
            raise
        for page, h in zip(got, hashes):
            seq.pages.append(page)
            seq.hashes.append(int(h))
            if self.prefix_caching:
                self.pool.register(page, int(h))
        seq.tokens.extend(int(t) for t in tokens)
        return got

    def reserve(self, seq_id: int, total_tokens: int) -> None:
        """Make sure the sequence has pages for `total_tokens` positions (allocating new ones).

        On CacheExhausted the pages allocated by this call are given back first, so a refused
        request leaves every sequence as it was.
        """
        seq = self.seqs[seq_id]
        need = -(-total_tokens // self.block_size) - len(seq.pages)
        got = []
        try:
            for _ in range(need):
                got.append(self.pool.allocate())
        except CacheExhausted:
            for p in got:
                self.pool.release(p)
            raise
        seq.pages.extend(got)

    def commit(self, seq_id: int, tokens) -> None:
        """Record that KV for `tokens` was written after the sequence's current end."""
        seq = self.seqs[seq_id]
        S = self.block_size
        if seq.num_tokens + len(tokens) > len(seq.pages) * S:
            raise ValueError(f"sequence {seq_id}: commit past reserved pages (reserve first).")
        seq.tokens.extend(int(t) for t in tokens)
        while len(seq.hashes) < seq.num_tokens // S:
            i = len(seq.hashes)
            prev = seq.hashes[-1] if seq.hashes else 0
            h = block_hash(prev, seq.tokens[i * S:(i + 1) * S])
            seq.hashes.append(h)
            if self.prefix_caching and seq.pages[i] != NULL_PAGE:
                self.pool.register(seq.pages[i], h)

    def fork(self, seq_id: int, new_id: int) -> list[PageCopy]:
        """A new sequence with the same KV: full pages shared, the partial last page copied."""
        src = self.seqs[seq_id]
        if new_id in self.seqs:
            raise ValueError(f"sequence {new_id} already exists.")
        S = self.block_size
        n_full = src.num_tokens // S
        # Allocate the copy first: if the pool is exhausted nothing has changed yet.
        dst = self.pool.allocate() if src.num_tokens % S else None
        new = SequenceKV(tokens=list(src.tokens), hashes=list(src.hashes))
        for p in src.pages[:n_full]:
            if p != NULL_PAGE:
                self.pool.acquire(p)
            new.pages.append(p)
        copies = []
        if dst is not None:
            copies.append(PageCopy(src.pages[n_full], dst))
            new.pages.append(dst)
        self.seqs[new_id] = new
        return copies

    def truncate(self, seq_id: int, keep: int) -> list[PageCopy]:
        """Keep the first `keep` tokens (rewind). Later pages are released; a partial last page
        is replaced by a private copy, since it will be written again and may be shared or
        registered as a cached full block."""
        seq = self.seqs[seq_id]
        if not 0 <= keep <= seq.num_tokens:
            raise ValueError(f"keep={keep} must be in [0, {seq.num_tokens}].")
        S = self.block_size
        n_pages = -(-keep // S)
        copies = []
        if keep % S:
            last = seq.pages[n_pages - 1]
            dst = self.pool.allocate()
            copies.append(PageCopy(last, dst))
            if last != NULL_PAGE:
                self.pool.release(last)
            seq.pages[n_pages - 1] = dst
        for p in seq.pages[n_pages:]:
            if p != NULL_PAGE:
                self.pool.release(p)
        del seq.pages[n_pages:]
        del seq.tokens[keep:]
        del seq.hashes[keep // S:]
        return copies

    def restore_sequence(self, seq_id: int, tokens, null_pages=()) -> list[tuple[int, int]]:
        """Recreate a sequence whose KV comes from elsewhere (a snapshot).

        Full pages whose chained hash is cached are shared (branches of one snapshot share
        pages); the others get fresh pages. Returns (logical index, physical page) pairs whose
        data the caller must write.
        """
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id} already exists.")
        S = self.block_size
        seq = SequenceKV()
        self.seqs[seq_id] = seq
        to_fill = []
        prev = 0
        try:
            for i in range(-(-len(tokens) // S)):
                chunk = tokens[i * S:(i + 1) * S]
                full = len(chunk) == S
                h = block_hash(prev, chunk) if full else None
                if i in null_pages:
                    seq.pages.append(NULL_PAGE)
                elif full and self.prefix_caching and self.pool.cached(h) is not None:
                    page = self.pool.cached(h)
                    self.pool.acquire(page)
                    seq.pages.append(page)
                else:
                    page = self.pool.allocate()
                    seq.pages.append(page)
                    to_fill.append((i, page))
                    if full and self.prefix_caching:
                        self.pool.register(page, h)
                if full:
                    seq.hashes.append(h)
                    prev = h
        except CacheExhausted:
            self.free(seq_id)
            raise
        seq.tokens = [int(t) for t in tokens]
        return to_fill

    def release_unwritten(self, seq_id: int) -> int:
        """Give back reserved pages past the sequence's last token (reserved for tokens that were
        computed ahead and then dropped); returns how many. Never registered: nothing else changes."""
        seq = self.seqs[seq_id]
        keep = -(-seq.num_tokens // self.block_size)
        extra = seq.pages[keep:]
        for p in extra:
            if p != NULL_PAGE:
                self.pool.release(p)
        del seq.pages[keep:]
        return len(extra)

    def free(self, seq_id: int) -> None:
        seq = self.seqs.pop(seq_id)
        for p in seq.pages:
            if p != NULL_PAGE:
                self.pool.release(p)

    def drop_outside_window(self, seq_id: int, window: int) -> int:
        """Release pages no future query can see under a sliding window (every layer's)."""
        if window <= 0:
            return 0
        seq = self.seqs[seq_id]
        next_pos = seq.num_tokens  # the earliest query still to come
        # Page i is dead when its last position i*S + S - 1 <= next_pos - window.
        dead = max(0, (next_pos - window + 1) // self.block_size)
        freed = 0
        for i in range(min(dead, len(seq.pages))):
            if seq.pages[i] != NULL_PAGE:
                self.pool.release(seq.pages[i])
                seq.pages[i] = NULL_PAGE
                freed += 1
        return freed

    # ---- allocation (what a scheduler asks before it plans a step) --------------------------
    def pages_to_write(self, seq_id: int, end: int) -> int:
        """New pages sequence `seq_id` needs to hold positions up to `end` (0 when it has them)."""
        return max(0, -(-end // self.block_size) - len(self.seqs[seq_id].pages))

    def can_admit(self, pages: int) -> bool:
        """Whether `pages` more pages can be allocated now (cached-prefix pages count as free)."""
        return pages <= self.pool.num_free

    def allocate_slots(self, seq_id: int, n: int) -> list[int] | None:
        """Pages for `n` more tokens after the sequence's current end: the new pages (maybe none),
        or None when the pool cannot give them, with nothing changed (the caller preempts)."""
        seq = self.seqs[seq_id]
        need = self.pages_to_write(seq_id, seq.num_tokens + n)
        if not self.can_admit(need):
            return None
        try:
            self.reserve(seq_id, seq.num_tokens + n)
        except CacheExhausted:  # a cached page counted as free was shared meanwhile
            return None
        return seq.pages[len(seq.pages) - need:] if need else []

    def usage(self) -> dict:
        """Pool occupancy: total (null page excluded), used, free, and live sequences."""
        return {"pages_total": self.pool.num_pages - 1, "pages_used": self.pool.num_used,
                "pages_free": self.pool.num_free, "sequences": len(self.seqs)}

    # ---- device boundary --------------------------------------------------------------------
    def block_tables(self, seq_ids, width: int) -> np.ndarray:
        """int32[len(seq_ids), width], padded with the null page."""
        out = np.full((len(seq_ids), width), NULL_PAGE, np.int32)
        for r, s in enumerate(seq_ids):
            pages = self.seqs[s].pages
            if len(pages) > width:
                raise ValueError(f"sequence {s} has {len(pages)} pages > block table width {width}.")
            out[r, :len(pages)] = pages
        return out

    def live_pages(self) -> set[int]:
        return {p for s in self.seqs.values() for p in s.pages if p != NULL_PAGE}
