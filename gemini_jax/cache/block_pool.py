"""`BlockPool`: who owns each physical KV page. Pure host bookkeeping, no arrays.

NOTE invariants (tested by property tests):
  * a page is either free (refcount 0, in the free queue) or owned (refcount > 0, not queued);
  * page 0 is the null page: never allocated, block tables pad with it;
  * a free page may still hold a cached full block (its hash is in `hash_to_page`) until it is
    handed out again — the free queue is in eviction order (least recently freed first), so
    cached blocks survive as long as possible.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional

from gemini_jax.errors import CacheExhausted

NULL_PAGE = 0


class BlockPool:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be >= 2 (page 0 is the null page).")
        self.num_pages = num_pages
        self.refcount = [0] * num_pages
        # OrderedDict as an O(1) queue with removal from the middle (a cached page revived).
        self.free_queue: OrderedDict[int, None] = OrderedDict((p, None) for p in range(1, num_pages))
        self.hash_to_page: dict[int, int] = {}
        self.page_to_hash: dict[int, int] = {}
        self.evictions = 0  # cached blocks dropped to make room

    # ---- queries ----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self.free_queue)

    def cached(self, block_hash: int) -> Optional[int]:
        return self.hash_to_page.get(block_hash)

    # ---- ownership --------------------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh page with refcount 1; evicts the least recently freed cached block if needed."""
        if not self.free_queue:
            raise CacheExhausted(
                f"all {self.num_pages - 1} KV pages are owned by live sequences; raise "
                f"CacheConfig.num_pages, shorten the requests, or free finished sequences.")
        page, _ = self.free_queue.popitem(last=False)
        old = self.page_to_hash.pop(page, None)
        if old is not None:
            del self.hash_to_page[old]
            self.evictions += 1
        self.refcount[page] = 1
        return page

    def acquire(self, page: int) -> None:
        """One more owner of `page` (a shared prefix block, or a cached block revived)."""
        if page == NULL_PAGE:
            raise ValueError("the null page cannot be owned.")
        if self.refcount[page] == 0:
            del self.free_queue[page]  # KeyError here would mean a corrupt pool
        self.refcount[page] += 1

    def release(self, page: int) -> None:
        """Drop one owner; at zero the page joins the tail of the free queue (content kept)."""
        if self.refcount[page] <= 0:
            raise ValueError(f"page {page} released more often than acquired.")
        self.refcount[page] -= 1
        if self.refcount[page] == 0:
            self.free_queue[page] = None

    def register(self, page: int, block_hash: int) -> None:
        """Record that `page` holds the full block `block_hash` (for prefix reuse)."""
        if block_hash in self.hash_to_page or page in self.page_to_hash:
            return  # first writer wins; a duplicate block simply is not shared
        self.hash_to_page[block_hash] = page
        self.page_to_hash[page] = block_hash

    def check(self) -> None:
        """Assert the invariants (used by tests; O(num_pages))."""
        assert self.refcount[NULL_PAGE] == 0 and NULL_PAGE not in self.free_queue
        for p in range(1, self.num_pages):
            assert (self.refcount[p] == 0) == (p in self.free_queue), p
            assert self.refcount[p] >= 0
        for h, p in self.hash_to_page.items():
            assert self.page_to_hash[p] == h
