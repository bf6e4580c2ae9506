"""`TierStack`: host RAM over an optional disk tier, run by a `TierConfig` (write policy,
corrupt-page policy).

Contract with the caller (the engine): a page is `put` below once it is full (and again if it
is ever rewritten), so evicting it from a device slot never needs a copy; a page freed by the
cache is `discard`ed. Every `get` returns copies: the caller owns them.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Optional

import numpy as np

from gemini_jax.errors import CacheExhausted, IntegrityError
from gemini_jax.config import TierConfig
from gemini_jax.tiers.errors import PageMissing, TierError
from gemini_jax.tiers.page import PageKey, PageSpec
from gemini_jax.tiers.stores import DiskOptions, DiskStore, HostStore


@dataclass(frozen=True)
class Fetched:
    """A page read from a tier below the device; `tier` is "host" or "disk"."""

    k: np.ndarray  # [kv_heads, block_size, head_dim]
    v: np.ndarray
    tier: str


class TierStack:
    """Host RAM over an optional disk tier, run by a `TierConfig`.

    write_through: `put` stores the page in host RAM (clean) and queues its disk write at once.
    write_back: `put` stores it in host RAM (dirty); it reaches disk when the host evicts it.
    A page read from disk is promoted into host RAM. With `on_corrupt="recompute"`, `get`
    returns None for a page that failed its checksum or is incomplete instead of raising (and
    counts it in `corrupt_pages`); the caller recomputes it and `put`s it again.
    """

    def __init__(self, spec: PageSpec, cfg: TierConfig):
        self.spec, self.cfg = spec, cfg
        self.disk: Optional[DiskStore] = None
        if cfg.disk_path is not None:
            self.disk = DiskStore(cfg.disk_path, spec, DiskOptions(
                layout=cfg.disk_layout, shard_pages=cfg.shard_pages, fsync=cfg.disk_fsync, io_workers=cfg.io_workers))
        self.host = HostStore(spec, cfg.host_pages, spill=self._spill if self.disk is not None else None)
        self._readers = ThreadPoolExecutor(cfg.io_workers, thread_name_prefix="gj-tier-read")
        self.corrupt_pages = 0

    def _spill(self, key: PageKey, data: np.ndarray) -> None:
        self.disk.put_stacked(key, data)

    def put(self, key: PageKey, k: np.ndarray, v: np.ndarray) -> None:
        """Store a full page below the device. Raises TierError when the disk tier has failed
        (the page is then kept in host RAM, dirty, and still served)."""
        data = self.spec.stack(k, v)
        if self.disk is None or self.cfg.write_policy == "write_back":
            self.host.put_stacked(key, data, dirty=True)
            return
        try:
            self.disk.put_stacked(key, data)  # both tiers only read `data`: no copy needed
        except TierError:
            self.host.put_stacked(key, data, dirty=True)
            raise
        self.host.put_stacked(key, data, dirty=False)

    def tier_of(self, key: PageKey) -> Optional[str]:
        """"host", "disk" or None (not stored below the device)."""
        if key in self.host:
            return "host"
        if self.disk is not None and self.disk.contains(key):
            return "disk"
        return None

    def get(self, key: PageKey) -> Optional[Fetched]:
        """The page from the fastest tier holding it. Raises PageMissing if no tier does."""
        page = self.host.get(key)
        if page is not None:
            return Fetched(page[0], page[1], "host")
        return self._from_disk(key)

    def _from_disk(self, key: PageKey) -> Optional[Fetched]:
        """A page not in host RAM, read from disk (verified) and promoted into host RAM."""
        if self.disk is None:
            raise PageMissing(f"page (layer={key[0]}, page={key[1]}) is in no tier below the device.")
        try:
            k, v = self.disk.get(key)
        except IntegrityError:
            if self.cfg.on_corrupt == "raise":
                raise
            self.corrupt_pages += 1
            return None
        try:
            self.host.put(key, k, v, dirty=False)
        except (TierError, CacheExhausted):
            pass  # no room above: serve it without promoting
        return Fetched(k, v, "disk")

    def get_many(self, keys) -> dict:
        """`get` of several keys: {key: Fetched, None (recompute), or the exception reading it
        raised}. Pages in host RAM come in one gather; the others are read one by one."""
        out: dict = {k: Fetched(kk, vv, "host") for k, (kk, vv) in self.host.get_many(keys).items()}
        for key in keys:
            if key not in out:
                try:
                    out[key] = self._from_disk(key)
                except Exception as err:  # noqa: BLE001 - the caller raises it at use
                    out[key] = err
        return out

    def get_async(self, key: PageKey) -> "Future[Optional[Fetched]]":
        return self._readers.submit(self.get, key)

    def host_pages(self) -> int:
        """(layer, page) units held in host RAM."""
        return len(self.host)

    def bytes_held(self) -> dict:
        """KV bytes held per tier: {"host": int, "disk": int (committed pages) or None}."""
        pb = self.spec.page_bytes
        return {"host": len(self.host) * pb,
                "disk": None if self.disk is None else len(self.disk.committed_pages()) * pb}

    def stats(self) -> dict:
        """Counters of the tiers below the device."""
        out = {"host_pages": len(self.host), "host_hits": self.host.hits, "host_misses": self.host.misses,
               "host_evictions": self.host.evictions, "host_spills": self.host.spills,
               "corrupt_pages": self.corrupt_pages}
        if self.disk is not None:
            out.update(disk_pages_written=self.disk.pages_written, disk_pages_read=self.disk.pages_read,
                       disk_write_seconds=self.disk.write_seconds, disk_read_seconds=self.disk.read_seconds,
                       disk_failed=self.disk.failure is not None)
        return out

    def discard(self, key: PageKey) -> None:
        """Forget a freed page in host RAM (its disk copy is overwritten when the id is reused)."""
        self.host.discard(key)

    def flush(self) -> None:
        if self.disk is not None:
            self.disk.flush()

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
