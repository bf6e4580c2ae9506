"""Page stores below the device: `HostStore` (a numpy pool in RAM) and `DiskStore` (tensorstore
zarr3 on the local file system). `gemini_jax.tiers.stack.TierStack` chains them. Every `get`
returns copies: the caller owns them.
"""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import tensorstore as ts

from gemini_jax.errors import CacheExhausted, IntegrityError
from gemini_jax.tiers.errors import IncompletePage, PageMissing, TierError
from gemini_jax.tiers.page import PageKey, PageSpec, page_digest
from gemini_jax.tiers.page_log import PageLog

Page = tuple[np.ndarray, np.ndarray]  # k, v: [kv_heads, block_size, head_dim]


# ---- host RAM -----------------------------------------------------------------------------------
_HOST_BLOCK = 256  # pages per block of the host pool


class HostStore:
    """A bounded pool of pages in host RAM with least-recently-used eviction.

    `capacity` pages (None = unbounded; the pool grows by blocks of pages, never copied). A page
    is *dirty* when the tier below does not hold its current content. When the pool is full,
    `put` evicts the least recently used page: a clean one is dropped, a dirty one is handed to `spill(key, data)`
    first (it must store it below or raise; the page is dropped only if `spill` returns). With
    no `spill`, a full pool of dirty pages raises `CacheExhausted`. Thread-safe.
    """

    def __init__(self, spec: PageSpec, capacity: Optional[int] = None, *,
                 spill: Optional[Callable[[PageKey, np.ndarray], None]] = None):
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity={capacity} must be None (unbounded) or >= 1.")
        self.spec = spec
        self.capacity = capacity
        self.spill = spill
        # Blocks of pages that are never copied when the pool grows (a doubling copy of a pool of
        # gigabytes would stall the step that triggers it). Slot s lives at block s // n, row s % n.
        self._block = min(capacity or _HOST_BLOCK, _HOST_BLOCK)
        self._blocks = [np.empty((self._block, 2, *spec.page_shape), spec.np_dtype)]
        self._free = list(range(self._block - 1, -1, -1))
        self._slot: OrderedDict[PageKey, int] = OrderedDict()  # LRU order: oldest first
        self._dirty: set[PageKey] = set()
        self._lock = threading.RLock()
        self.hits = self.misses = self.evictions = self.spills = 0

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, key: PageKey) -> bool:
        return tuple(key) in self._slot

    def keys(self) -> list[PageKey]:
        """Resident keys, least recently used first."""
        with self._lock:
            return list(self._slot)

    def is_dirty(self, key: PageKey) -> bool:
        return tuple(key) in self._dirty

    def put(self, key: PageKey, k: np.ndarray, v: np.ndarray, *, dirty: bool = True) -> None:
        """Store (a copy of) page `key`, replacing an older version; may evict the LRU page."""
        self.put_stacked(key, self.spec.stack(k, v), dirty=dirty)

    def put_stacked(self, key: PageKey, data: np.ndarray, *, dirty: bool = True) -> None:
        """`put` of an already stacked [2, kv_heads, block_size, head_dim] page."""
        key = self.spec.check_key(key)
        self.spec.check_stacked(data)
        with self._lock:
            slot = self._slot.get(key)
            if slot is None:
                slot = self._take_slot()
                self._slot[key] = slot
            self._slot.move_to_end(key)
            self._row(slot)[...] = data
            if dirty:
                self._dirty.add(key)
            else:
                self._dirty.discard(key)

    def get(self, key: PageKey) -> Optional[Page]:
        """Copies (k, v) of the page, or None when the host does not hold it. Marks it recent."""
        key = tuple(key)
        with self._lock:
            slot = self._slot.get(key)
            if slot is None:
                self.misses += 1
                return None
            self._slot.move_to_end(key)
            self.hits += 1
            data = self._row(slot).copy()
        return data[0], data[1]

    def get_many(self, keys) -> dict:
        """`get` of several keys under one lock and one gather: {key: (k, v)} for the keys held
        (each a view into one fresh copy); keys not held are left out (and counted as misses)."""
        with self._lock:
            held = [(tuple(k), self._slot.get(tuple(k))) for k in keys]
            held = [(k, s) for k, s in held if s is not None]
            self.misses += len(keys) - len(held)
            self.hits += len(held)
            if not held:
                return {}
            for k, _ in held:
                self._slot.move_to_end(k)
            data = np.stack([self._row(s) for _, s in held])
        return {k: (data[i, 0], data[i, 1]) for i, (k, _) in enumerate(held)}

    def discard(self, key: PageKey) -> bool:
        """Forget the page (it was freed). Returns whether it was held."""
        key = tuple(key)
        with self._lock:
            slot = self._slot.pop(key, None)
            if slot is None:
                return False
            self._dirty.discard(key)
            self._free.append(slot)
            return True

    def _row(self, slot: int) -> np.ndarray:
        return self._blocks[slot // self._block][slot % self._block]

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        n = len(self._blocks) * self._block
        if self.capacity is None or n < self.capacity:
            self._blocks.append(np.empty_like(self._blocks[0]))
            top = n + self._block if self.capacity is None else min(n + self._block, self.capacity)
            self._free.extend(range(top - 1, n, -1))
            return n
        return self._evict()

    def _evict(self) -> int:
        victim = next(iter(self._slot))
        slot = self._slot[victim]
        if victim in self._dirty:
            if self.spill is None:
                raise CacheExhausted(
                    f"the host tier is full ({self.capacity} pages) and page (layer={victim[0]}, "
                    f"page={victim[1]}) exists nowhere below it; raise tier.host_pages or set tier.disk_path.")
            self.spill(victim, self._row(slot).copy())  # raises -> nothing is dropped
            self.spills += 1
            self._dirty.discard(victim)
        del self._slot[victim]
        self.evictions += 1
        return slot


# ---- disk ----------------------------------------------------------------------------------------
def _zarr_metadata(spec: PageSpec, layout: str, shard_pages: int) -> dict:
    page_chunk = [1, 1, 2, *spec.page_shape]
    raw = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if layout == "chunked":
        grid, codecs = page_chunk, raw
    else:
        grid = [1, min(shard_pages, spec.num_pages), 2, *spec.page_shape]
        codecs = [{"name": "sharding_indexed", "configuration": {
            "chunk_shape": page_chunk, "codecs": raw,
            "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
            "index_location": "end"}}]
    return {"shape": [spec.num_layers, spec.num_pages, 2, *spec.page_shape], "data_type": spec.np_dtype.name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": grid}},
            "codecs": codecs, "fill_value": 0}


def _ts_reason(e: Exception) -> str:
    """The useful part of a tensorstore error: drop the embedded spec JSON."""
    msg = str(e)
    cut = msg.find(" [tensorstore_spec=")
    return msg if cut < 0 else msg[:cut]


@dataclass(frozen=True, kw_only=True)
class DiskOptions:
    """How a `DiskStore` lays out and writes its pages."""

    layout: str = "chunked"  # "chunked": one zarr chunk per (layer, page); "sharded": shard_pages per file
    shard_pages: int = 64
    fsync: bool = False  # fsync every write batch and log record
    io_workers: int = 4  # reader threads (and tensorstore's file I/O concurrency, at least 4)
    write_batch: int = 64  # pages the writer thread writes at once
    max_pending: int = 1024  # pages a `put` may queue before it waits for the writer
    cache_bytes: Optional[int] = None  # tensorstore's cache (None: 0 chunked, 8 MiB sharded, for shard indexes)

    def __post_init__(self):
        if self.layout not in ("chunked", "sharded"):
            raise ValueError(f"layout={self.layout!r} must be 'chunked' or 'sharded'.")


class DiskStore:
    """Pages on the local file system as a zarr3 array `[layers, pages, 2, kv_heads, block_size,
    head_dim]` (tensorstore), one chunk per (layer, page) ("chunked") or `shard_pages` pages of a
    layer per file ("sharded").

    Writes are asynchronous: `put` copies the page into a pending buffer and returns; a writer
    thread writes pending pages in batches (INTENT in the page log, data, then COMMIT with the
    page's checksum). A pending page is served from memory, so reads always see the last `put`.
    `flush()` waits for every pending write. Reads verify the checksum.

    Errors: an unwritable path raises `TierError` here, at construction. A failed write (disk
    full, file system gone read-only) is raised as `TierError` by the next `put` or `flush`;
    from then on the store refuses writes but keeps serving what it holds (pending pages stay in
    memory). `get` raises `IntegrityError` naming layer and page when the bytes do not match the
    checksum, `IncompletePage` for a write cut short by a crash, `PageMissing` for a page never
    stored.
    """

    def __init__(self, path: str, spec: PageSpec, options: Optional[DiskOptions] = None):
        options = options or DiskOptions()
        layout, fsync, io_workers, cache_bytes = options.layout, options.fsync, options.io_workers, options.cache_bytes
        self.path, self.spec, self.layout = os.path.abspath(path), spec, layout
        self.write_batch, self.max_pending = options.write_batch, options.max_pending
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise TierError(f"cannot create the disk tier directory {self.path!r}: {e.strerror} "
                            f"(errno {e.errno}); choose a writable tier.disk_path.") from e
        if cache_bytes is None:  # sharded reads need the shard index: keep recent ones in memory
            cache_bytes = 0 if layout == "chunked" else 8 * 2**20
        context = {"cache_pool": {"total_bytes_limit": int(cache_bytes)}, "file_io_sync": bool(fsync),
                   "file_io_concurrency": {"limit": max(4, io_workers)}}
        ts_spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": os.path.join(self.path, "kv.zarr")},
                   "metadata": _zarr_metadata(spec, layout, options.shard_pages), "context": context}
        try:
            self._array = ts.open(ts_spec, create=True, open=True).result()
        except ValueError as e:
            raise TierError(f"cannot open the disk tier at {self.path!r} (layout={layout!r}, {spec}): "
                            f"{_ts_reason(e)}. Choose a writable, empty tier.disk_path, or the layout "
                            f"and shapes it was created with.") from e
        self._log = PageLog(os.path.join(self.path, "kv.checksums"), fsync=fsync)
        self._lock = threading.Condition()
        self._pending: dict[PageKey, tuple[int, np.ndarray]] = {}  # key -> (generation, data)
        self._queue: OrderedDict[PageKey, None] = OrderedDict()  # keys whose latest put is unwritten
        self._in_flight = 0
        self._gen = 0
        self._failure: Optional[TierError] = None
        self._closed = False
        self._readers = ThreadPoolExecutor(io_workers, thread_name_prefix="gj-disk-read")
        self._writer = threading.Thread(target=self._write_loop, name="gj-disk-write", daemon=True)
        self._writer.start()
        self.pages_written = self.pages_read = 0
        self.write_seconds = self.read_seconds = 0.0

    # ---- state --------------------------------------------------------------------------------
    @property
    def failure(self) -> Optional[TierError]:
        """The write error that disabled the store, if any."""
        return self._failure

    def contains(self, key: PageKey) -> bool:
        """Whether `get(key)` would find the page (pending or committed; not verified)."""
        key = tuple(key)
        with self._lock:
            return key in self._pending or key in self._log.committed

    def incomplete_pages(self) -> list[PageKey]:
        """Pages whose last write began but never committed (never served)."""
        with self._lock:
            return sorted(k for k in self._log.incomplete if k not in self._pending)

    def committed_pages(self) -> list[PageKey]:
        with self._lock:
            return sorted(self._log.committed)

    # ---- writes -------------------------------------------------------------------------------
    def put(self, key: PageKey, k: np.ndarray, v: np.ndarray) -> None:
        self.put_stacked(key, self.spec.stack(k, v))

    def put_stacked(self, key: PageKey, data: np.ndarray) -> None:
        """Queue an asynchronous write of a [2, kv_heads, block_size, head_dim] page (not copied:
        the caller hands it over). Blocks while `max_pending` pages wait for the disk (back
        pressure bounds the memory of the pending buffer). Raises TierError if an earlier write
        failed."""
        key = self.spec.check_key(key)
        self.spec.check_stacked(data)
        with self._lock:
            while len(self._queue) >= self.max_pending and self._failure is None and key not in self._queue:
                self._lock.wait()
            self._raise_failure()
            if self._closed:
                raise TierError(f"the disk tier at {self.path!r} is closed.")
            self._gen += 1
            self._pending[key] = (self._gen, data)
            self._queue[key] = None
            self._queue.move_to_end(key)
            self._lock.notify_all()

    def flush(self) -> None:
        """Block until every queued write is committed; raise TierError if one failed."""
        with self._lock:
            while (self._queue or self._in_flight) and self._failure is None:
                self._lock.wait()
            self._raise_failure()

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure

    def _write_loop(self) -> None:
        while True:
            with self._lock:
                while not self._queue and not self._closed:
                    self._lock.wait()
                if not self._queue:  # closed and drained
                    return
                if self._failure is not None:  # refuse the rest; pending pages stay readable
                    self._queue.clear()
                    self._lock.notify_all()
                    continue
                batch = []
                while self._queue and len(batch) < self.write_batch:
                    key, _ = self._queue.popitem(last=False)
                    gen, data = self._pending[key]
                    batch.append((key, gen, data))
                self._in_flight = len(batch)
                self._lock.notify_all()  # room in the queue for blocked puts
            try:
                self._write_batch(batch)
            except Exception as e:  # noqa: BLE001 - any failure disables writes, never the thread
                err = e if isinstance(e, TierError) else TierError(
                    f"disk tier write failed at {self.path!r}: {e!r}. The disk tier is now read-only.")
                with self._lock:
                    self._failure = err
            finally:
                with self._lock:
                    self._in_flight = 0
                    self._lock.notify_all()

    def _write_batch(self, batch) -> None:
        """INTENT for every page of the batch, their data in one transaction (pages of one shard
        are written together), then COMMIT with their checksums."""
        t0 = time.perf_counter()
        digests = [(key, page_digest(key, data)) for key, _, data in batch]
        with self._lock:
            self._log.begin(key for key, _, _ in batch)
        try:
            txn = ts.Transaction()
            writes = [self._array.with_transaction(txn)[key[0], key[1]].write(data) for key, _, data in batch]
            for w in writes:
                w.copy.result()
            txn.commit_async().result()
        except ValueError as e:
            first = batch[0][0]
            raise TierError(
                f"disk tier write failed at {self.path!r} (a batch of {len(batch)} pages from layer={first[0]}, "
                f"page={first[1]}): {_ts_reason(e)}. The disk tier is now read-only; pages above it are "
                f"still served. Free space or choose another tier.disk_path.") from e
        with self._lock:
            self._log.commit(digests)
            for key, gen, _ in batch:
                if self._pending.get(key, (None,))[0] == gen:  # not re-put meanwhile
                    del self._pending[key]
            self.pages_written += len(batch)
            self.write_seconds += time.perf_counter() - t0

    # ---- reads --------------------------------------------------------------------------------
    def get(self, key: PageKey) -> Page:
        """Copies (k, v) of the page, verified against its checksum."""
        key = self.spec.check_key(key)
        layer, page = key
        for _ in range(3):  # a concurrent re-put of the key changes the digest: read again
            with self._lock:
                if key in self._pending:
                    data = self._pending[key][1].copy()
                    return data[0], data[1]
                digest = self._log.committed.get(key)
                if digest is None:
                    if key in self._log.incomplete:
                        raise IncompletePage(
                            f"disk page (layer={layer}, page={page}) at {self.path!r} was being written when "
                            f"its process stopped; it is incomplete and will not be served. Recompute it.")
                    raise PageMissing(f"disk page (layer={layer}, page={page}) was never stored at {self.path!r}.")
            t0 = time.perf_counter()
            try:
                data = self._array[layer, page].read().result()
            except ValueError as e:
                raise IntegrityError(f"disk page (layer={layer}, page={page}) at {self.path!r} cannot be "
                                     f"read back: {_ts_reason(e)}. Recompute the page.") from e
            if page_digest(key, data) == digest:
                with self._lock:
                    self.pages_read += 1
                    self.read_seconds += time.perf_counter() - t0
                return data[0], data[1]
            with self._lock:
                if key in self._pending or self._log.committed.get(key) != digest:
                    continue
            raise IntegrityError(f"disk page (layer={layer}, page={page}) at {self.path!r} failed its "
                                 f"checksum: its bytes changed after they were written. Recompute the page.")
        raise IntegrityError(f"disk page (layer={layer}, page={page}) kept changing while being read.")

    def get_async(self, key: PageKey) -> "Future[Page]":
        """`get` on a reader thread."""
        return self._readers.submit(self.get, key)

    # ---- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Flush, stop the threads and release the store (raises a pending write failure)."""
        if self._closed:
            return
        try:
            self.flush()
        finally:
            with self._lock:
                self._closed = True
                self._lock.notify_all()
            self._writer.join()
            self._readers.shutdown(wait=True)
            self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
