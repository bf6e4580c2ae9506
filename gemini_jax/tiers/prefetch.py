"""Predictive prefetch: `Predictor` guesses which (layer, page) units the next layers will read,
`Prefetcher` fetches them from the tiers below into a staging buffer while the device computes.

One decode step over tiers, layer by layer (docs/architecture.md §8):

    for layer in range(num_layers):
        selected = ...                                    # on device, from digests
        for a in slots.ensure(keys_of(selected)):         # residency.DeviceSlots
            if not a.hit:                                 # hits are free
                page = prefetcher.get(a.key)              # staged -> hit; else a timed stall
                ...copy page.k / page.v into pool[layer, :, a.slot]
        predictor.observe(layer, block_tables, selected, lengths)
        prefetcher.schedule(k for k in predictor.predict(layer) if k not in slots)
        ...attend(layer)

The staging buffer is the second buffer of double buffering: fetches for layers ahead land
there while the current layer reads the device pool.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Iterable, Optional, Protocol

import numpy as np

from gemini_jax.config import TierConfig
from gemini_jax.tiers.link import Links
from gemini_jax.tiers.page import PageKey
from gemini_jax.tiers.stack import Fetched


class PageSource(Protocol):
    """What the prefetcher reads from (a `TierStack`)."""

    def get(self, key: PageKey) -> Optional[Fetched]: ...


class Predictor:
    """Predict the keys of the next `prefetch_depth` layers.

    Two sources. History: for each layer, the pages selected at its last visit, their neighbours
    (logical page +/- 1, within the sequence) and the sequence's sink and local pages — layers
    l+1 .. l+depth (wrapping into the next step) will most likely read about what they read last
    step. Lookahead (`speculate`): a selection for a layer of the *current* step made ahead of
    time by the runner (layer l+depth's digests scored with a query built from layer l's input),
    which catches the pages a step selects for the first time; history cannot. Lookahead keys
    come first.
    """

    def __init__(self, cfg: TierConfig, num_layers: int, *, block_size: int):
        self.depth = cfg.prefetch_depth
        self.sink, self.local = cfg.pin_sink_pages, cfg.pin_local_pages
        self.num_layers = num_layers
        self.block_size = block_size
        self._last: list[list[int]] = [[] for _ in range(num_layers)]  # physical pages, by priority
        self._ahead: list[list[int]] = [[] for _ in range(num_layers)]  # this step's lookahead, if any

    @staticmethod
    def _pages(bt, selected, b, n_pages):
        s = np.asarray(selected[b]).ravel()
        return np.unique(s[(s >= 0) & (s < n_pages)])

    def speculate(self, layer: int, block_tables, selected, lengths) -> None:
        """A selection [B, K, k] (logical ids, -1 padded) predicted for `layer` of the current step;
        used by `predict` until `observe(layer)` records what the layer really read."""
        bt, lengths = np.asarray(block_tables), np.asarray(lengths)
        pages = []
        for b in range(bt.shape[0]):
            n_pages = -(-int(lengths[b]) // self.block_size)
            pages.extend(bt[b, self._pages(bt, selected, b, n_pages)].tolist())
        self._ahead[layer] = [p for p in dict.fromkeys(pages) if p != 0]

    def observe(self, layer: int, block_tables, selected, lengths) -> None:
        """Record what `layer` read this step.

        block_tables int[B, W] (physical page ids, 0 = null); selected int[B, k] or int[B, K, k]
        (logical page ids per sequence (and kv head), -1 = padding; None = every page, i.e.
        dense attention); lengths int[B] (tokens in the sequence).
        """
        bt = np.asarray(block_tables)
        lengths = np.asarray(lengths)
        first, second, third = [], [], []
        for b in range(bt.shape[0]):
            n_pages = -(-int(lengths[b]) // self.block_size)
            sel = np.arange(n_pages) if selected is None else self._pages(bt, selected, b, n_pages)
            near = np.setdiff1d(np.concatenate([sel - 1, sel + 1]), sel)
            near = near[(near >= 0) & (near < n_pages)]
            fixed = np.concatenate([np.arange(min(self.sink, n_pages)),
                                    np.arange(max(0, n_pages - self.local), n_pages)])
            first.extend(bt[b, sel].tolist())
            second.extend(bt[b, near].tolist())
            third.extend(bt[b, fixed].tolist())
        self._last[layer] = [p for p in dict.fromkeys(first + second + third) if p != 0]
        self._ahead[layer] = []

    def lookahead_keys(self, layer: int) -> list[PageKey]:
        """The keys of `layer`'s pending lookahead (empty if none)."""
        return [(layer, p) for p in self._ahead[layer]]

    def predict(self, layer: int) -> list[PageKey]:
        """Keys to fetch while `layer` computes, nearest layer first (empty when depth is 0)."""
        nxt = [(layer + d) % self.num_layers for d in range(1, min(self.depth, self.num_layers) + 1)]
        # Every lookahead first (it is this step's own selection; history is last step's guess),
        # so a bounded staging buffer spends itself on the likeliest pages.
        keys = [(j, p) for j in nxt for p in self._ahead[j]]
        keys += [(j, p) for j in nxt for p in self._last[j]]
        return list(dict.fromkeys(keys))


class Prefetcher:
    """Asynchronous fetches from a `PageSource` into a bounded staging buffer.

    `schedule(keys)` starts fetches (up to `capacity` pages staged or in flight); `take(key)`
    returns a staged page that has arrived (a prefetch hit) or None; `fetch(key)` is the miss
    path: it waits for an in-flight fetch of the key or reads it synchronously, and the wait is
    counted as stall. `get(key)` = `take` or `fetch`. Counters: prefetch_hits, prefetch_misses,
    prefetch_late (misses that were in flight), prefetch_wasted (staged, never taken),
    pages_fetched_host, pages_fetched_disk, stall_seconds.
    """

    def __init__(self, source: PageSource, *, capacity: int = 256, workers: int = 4, batch: int = 16,
                 links: Optional[Links] = None):
        self.source = source
        self.capacity = capacity
        self.batch = batch
        # Emulated links (tier.link="emulate"): a staged page counts as arrived only from the time
        # the link model lands it; None: when its read is done.
        self.links = links
        self._land: dict[PageKey, float] = {}
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="gj-prefetch")
        # key -> the future of the batch that reads it; a batch's result maps its keys to pages
        # (or to the exception reading that one key raised). One future per batch, not per key:
        # a decode step schedules hundreds of guesses, and a thread hand-off each is the cost.
        self._staged: dict[PageKey, Future] = {}
        self._by_layer: dict[int, set] = {}
        self._lock = threading.Lock()
        self.stats = {"prefetch_hits": 0, "prefetch_misses": 0, "prefetch_late": 0, "prefetch_wasted": 0,
                      "prefetch_issued": 0, "pages_fetched_host": 0, "pages_fetched_disk": 0,
                      "stall_seconds": 0.0}

    def _read(self, key: PageKey) -> Optional[Fetched]:
        page = self.source.get(key)
        if page is not None:
            with self._lock:
                self.stats[f"pages_fetched_{page.tier}"] += 1
        return page

    def _read_batch(self, keys: list) -> dict:
        many = getattr(self.source, "get_many", None)
        if many is not None:  # one gather for the pages in host RAM
            out = many(keys)
            counts = {"host": 0, "disk": 0}
            for page in out.values():
                if isinstance(page, Fetched):
                    counts[page.tier] += 1
            with self._lock:
                self.stats["pages_fetched_host"] += counts["host"]
                self.stats["pages_fetched_disk"] += counts["disk"]
            return out
        out = {}
        for key in keys:
            try:
                out[key] = self._read(key)
            except Exception as err:  # noqa: BLE001 - raised again, properly, by `fetch` at use
                out[key] = err
        return out

    def _pop(self, key: PageKey) -> Optional[Future]:
        """Unstage `key` (lock held)."""
        fut = self._staged.pop(key, None)
        self._land.pop(key, None)
        if fut is not None:
            self._by_layer[key[0]].discard(key)
        return fut

    def _tier(self, key: PageKey) -> str:
        """Where a page will come from, for the link model ("host" when the source cannot say)."""
        tier_of = getattr(self.source, "tier_of", None)
        return (tier_of(key) if tier_of is not None else None) or "host"

    def _wait_link(self, land: Optional[float]) -> None:
        """Sleep until an emulated transfer lands (no CPU spent, as on a DMA)."""
        if land is not None:
            left = land - time.perf_counter()
            if left > 0:
                time.sleep(left)

    @staticmethod
    def _page(fut: Future, key: PageKey) -> Optional[Fetched]:
        """The page a finished batch read for `key`, or None if that read failed or found nothing."""
        if fut.exception() is not None:
            return None
        page = fut.result().get(key)
        return None if isinstance(page, Exception) else page

    def schedule(self, keys: Iterable[PageKey]) -> int:
        """Start fetching `keys` (most wanted first) not already staged; returns how many fetches
        were issued. A full buffer skips the remaining keys: what is staged was asked for earlier
        with a higher priority, and a layer's unused guesses leave with `release_layer`."""
        with self._lock:
            room = self.capacity - len(self._staged)
            todo = []
            for key in keys:
                if len(todo) >= room:
                    break
                key = (int(key[0]), int(key[1]))
                if key not in self._staged:
                    self._staged[key] = None  # reserved; the batch future is filled in below
                    todo.append(key)
            for i in range(0, len(todo), self.batch):
                part = todo[i:i + self.batch]
                if self.links is not None:  # one transfer per batch, timed by the link model
                    tiers = [self._tier(key) for key in part]
                    land = self.links.transfer(tiers.count("host"), len(tiers) - tiers.count("host"),
                                               time.perf_counter())
                    self._land.update((key, land) for key in part)
                fut = self._pool.submit(self._read_batch, part)
                for key in part:
                    self._staged[key] = fut
                    self._by_layer.setdefault(key[0], set()).add(key)
            self.stats["prefetch_issued"] += len(todo)
        return len(todo)

    def set_links(self, links: Optional[Links]) -> None:
        """Time transfers with `links` from now on (None: real). What is staged is dropped (counted
        as wasted): its landing times belong to the old links."""
        with self._lock:
            self.stats["prefetch_wasted"] += len(self._staged)
            self._staged.clear()
            self._by_layer.clear()
            self._land.clear()
            self.links = links

    def release_layer(self, layer: int) -> int:
        """Drop the staged pages of `layer` once it has read what it needed: guesses it did not
        use (counted as wasted) would otherwise hold the buffer until the layer's next visit."""
        with self._lock:
            stale = list(self._by_layer.get(layer, ()))
            for k in stale:
                self._pop(k)
            self.stats["prefetch_wasted"] += len(stale)
        return len(stale)

    def invalidate(self, key: PageKey) -> None:
        """Forget a staged copy of `key` (its page was freed or rewritten)."""
        with self._lock:
            self._pop((int(key[0]), int(key[1])))

    def in_flight(self, key: PageKey) -> bool:
        with self._lock:
            fut = self._staged.get(key)
        return fut is not None and not fut.done()

    def take(self, key: PageKey) -> Optional[Fetched]:
        """The staged page if its fetch has completed (counted as a hit), else None (nothing counted:
        the caller goes on to `fetch`, which counts the miss)."""
        key = (int(key[0]), int(key[1]))
        with self._lock:
            fut = self._staged.get(key)
            if fut is None or not fut.done():
                return None
            land = self._land.get(key)
            if land is not None and time.perf_counter() < land:
                return None  # read here, but still on the emulated link
            page = self._page(fut, key)
            if page is None:
                return None  # a failed prefetch is retried by `fetch`, which raises properly
            self._pop(key)
            self.stats["prefetch_hits"] += 1
        return page

    def fetch(self, key: PageKey) -> Optional[Fetched]:
        """Miss path: wait for the key's in-flight fetch, or read it now. Counted as a miss; the
        time spent here is stall. Returns what the source returns (None: recompute the page)."""
        key = (int(key[0]), int(key[1]))
        t0 = time.perf_counter()
        with self._lock:
            land = self._land.get(key)
            fut = self._pop(key)
            self.stats["prefetch_misses"] += 1
            if fut is not None and (not fut.done() or (land is not None and t0 < land)):
                self.stats["prefetch_late"] += 1
        try:
            page = None if fut is None else self._page(fut, key)
            if page is None:
                if self.links is not None:  # a demand read crosses the link too
                    tier = self._tier(key)
                    land = self.links.transfer(int(tier == "host"), int(tier != "host"), t0)
                page = self._read(key)
            self._wait_link(land)
            return page
        finally:
            with self._lock:
                self.stats["stall_seconds"] += time.perf_counter() - t0

    def get(self, key: PageKey) -> Optional[Fetched]:
        """A page the device needs now: a staged hit, or a (timed) miss."""
        page = self.take(key)
        return page if page is not None else self.fetch(key)

    def drain(self) -> None:
        """Wait for every fetch in flight (tests, end of a run)."""
        with self._lock:
            futs = {id(f): f for f in self._staged.values()}
        for f in futs.values():
            f.exception()

    def hit_rate(self) -> float:
        n = self.stats["prefetch_hits"] + self.stats["prefetch_misses"]
        return self.stats["prefetch_hits"] / n if n else 0.0

    def close(self) -> None:
        self._pool.shutdown(wait=True)
