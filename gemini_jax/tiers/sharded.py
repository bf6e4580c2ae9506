"""`ShardedTierStack`: the tiers below the device for a page pool sharded by kv head over a
mesh's `model` axis — one `TierStack` per shard, each with its own host pool and its own zarr
array on disk (`<disk_path>/shard<i>of<m>/`).

Each device's heads go down and come back through their own store: writes of different shards
never share a file, a lock or a writer thread, and a corrupt page is named with its shard. The
engine still moves a page as one unit (all kv heads of one (layer, page)): `put` splits it by
head, `get` reads every shard's part (in parallel) and joins them. Page keys, budgets
(`host_pages` counts (layer, page) units, so each shard holds that many units of its heads) and
policies are the unsharded stack's.
"""

from __future__ import annotations

import dataclasses
import os
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Optional

import numpy as np

from gemini_jax.config import TierConfig
from gemini_jax.errors import ConfigError, IntegrityError
from gemini_jax.tiers.page import PageKey, PageSpec
from gemini_jax.tiers.stack import Fetched, TierStack


class ShardedTierStack:
    """`shards` TierStacks over equal kv-head slices of `spec`, with `TierStack`'s interface."""

    def __init__(self, spec: PageSpec, cfg: TierConfig, shards: int):
        if shards < 1 or spec.kv_heads % shards:
            raise ConfigError(f"{shards=} must be >= 1 and divide kv_heads={spec.kv_heads} (one slice of "
                              f"heads per shard of the mesh's model axis).")
        self.spec, self.cfg, self.shards = spec, cfg, shards
        self.heads = spec.kv_heads // shards
        part = dataclasses.replace(spec, kv_heads=self.heads)
        self.parts = []
        for i in range(shards):
            c = cfg if cfg.disk_path is None else dataclasses.replace(
                cfg, disk_path=os.path.join(cfg.disk_path, f"shard{i}of{shards}"))
            self.parts.append(TierStack(part, c))
        self._readers = ThreadPoolExecutor(max(cfg.io_workers, shards), thread_name_prefix="gj-shard-read")

    def _slice(self, i: int) -> slice:
        return slice(i * self.heads, (i + 1) * self.heads)

    def put(self, key: PageKey, k: np.ndarray, v: np.ndarray) -> None:
        """Each shard stores its heads of the page (TierError from a failed disk tier, as TierStack)."""
        k, v = np.asarray(k), np.asarray(v)
        for i, part in enumerate(self.parts):
            part.put(key, k[self._slice(i)], v[self._slice(i)])

    def get(self, key: PageKey) -> Optional[Fetched]:
        """The page joined from every shard; "disk" if any shard read it from disk. None when a
        shard refused a corrupt page (on_corrupt="recompute")."""
        futs = [self._readers.submit(part.get, key) for part in self.parts]
        got = []
        for i, f in enumerate(futs):
            try:
                got.append(f.result())
            except IntegrityError as e:
                raise IntegrityError(f"shard {i} of {self.shards} (kv heads {self._slice(i).start}.."
                                     f"{self._slice(i).stop - 1}): {e}") from e
        if any(g is None for g in got):
            return None
        tier = "disk" if any(g.tier == "disk" for g in got) else "host"
        return Fetched(np.concatenate([g.k for g in got]), np.concatenate([g.v for g in got]), tier)

    def get_async(self, key: PageKey) -> "Future[Optional[Fetched]]":
        return self._readers.submit(self.get, key)

    def tier_of(self, key: PageKey) -> Optional[str]:
        """The slowest tier any shard holds the page in ("host", "disk") or None if a shard lacks it."""
        tiers = [part.tier_of(key) for part in self.parts]
        if None in tiers:
            return None
        return "disk" if "disk" in tiers else "host"

    def discard(self, key: PageKey) -> None:
        for part in self.parts:
            part.discard(key)

    def host_pages(self) -> int:
        """(layer, page) units in host RAM (a unit counts once all shards hold their part)."""
        return min(part.host_pages() for part in self.parts)

    def bytes_held(self) -> dict:
        out = {"host": 0, "disk": None}
        for part in self.parts:
            b = part.bytes_held()
            out["host"] += b["host"]
            if b["disk"] is not None:
                out["disk"] = (out["disk"] or 0) + b["disk"]
        return out

    @property
    def corrupt_pages(self) -> int:
        return sum(part.corrupt_pages for part in self.parts)

    def stats(self) -> dict:
        """Counters summed over the shards (`disk_failed`: any shard's disk failed)."""
        out: dict = {"shards": self.shards}
        for part in self.parts:
            for k, v in part.stats().items():
                if isinstance(v, bool):
                    out[k] = out.get(k, False) or v
                else:
                    out[k] = out.get(k, 0) + v
        out["host_pages"] = self.host_pages()
        return out

    def flush(self) -> None:
        for part in self.parts:
            part.flush()

    def close(self) -> None:
        self._readers.shutdown(wait=True)
        for part in self.parts:
            part.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
