"""The tiered KV store: pages of every layer in a bounded set of device slots, the rest in host
RAM and on disk (`TierStack`), with digests of every page on device so selection never waits
for I/O. Same interface as `gemini_jax.cache.store.PooledStore` (`device`, `update`, `gather`,
`scatter`, `copy_pages`, `stats`, `close`), plus residency: `admit` (make pages resident, reading
misses from below through the prefetcher), `put_below` (write-through of filled pages),
`prefetch`, `forget`.

Exactness: a page's bytes are the same in a slot, in host RAM and on disk, and digests live on
device for every page, so selection is the all-resident selection.

Quantized KV (int8 / float8_e4m3fn): slots hold `kvquant.QuantPages` (data + per-vector scales),
as the all-resident pool does; below the device a page is held packed (`kvquant.pack`, one byte
array with its scales: `gemini_jax.tiers.page`). Pages are packed on device as they leave a slot
and unpacked as they enter one; `gather` / `scatter` speak the pool's form (QuantPages).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from gemini_jax import distributed
from gemini_jax.attention import digests as page_digests
from gemini_jax.attention import kvquant
from gemini_jax.cache.shapes import pow2_at_least
from gemini_jax.cache.store import DeviceKV
from gemini_jax.config import EngineConfig, ModelConfig
from gemini_jax.errors import IntegrityError
from gemini_jax.tiers.errors import PageCorrupt, TierError
from gemini_jax.tiers.link import Links
from gemini_jax.tiers.observe import SelectionObserver
from gemini_jax.tiers.page import PageSpec
from gemini_jax.tiers.prefetch import Predictor, Prefetcher
from gemini_jax.tiers.residency import DeviceSlots, HotZone
from gemini_jax.tiers.sharded import ShardedTierStack
from gemini_jax.tiers.stack import TierStack
from gemini_jax.tiers.write_log import WriteLog


@functools.partial(jax.jit, donate_argnums=(0, 1))
def _fill(k_slots, v_slots, layer, slots, k, v):
    """Pages k, v [n, K, S, D] into `slots` [n] of `layer` (out-of-range slots: padding, dropped)."""
    at = (layer, slice(None), slots)  # numpy indexing: the slots' axis comes first, as in k and v
    return kvquant.write(k_slots, at, k, mode="drop"), kvquant.write(v_slots, at, v, mode="drop")


@jax.jit
def _read(k_slots, v_slots, layer, slots):
    """Pages in `slots` [n] of `layer` -> k, v [n, K, S, row] as the tiers store them (quantized
    pages packed with their scales)."""
    def pages(slots_):
        x = jax.tree.map(lambda a: jnp.moveaxis(a, 1, 0), slots_[layer][:, slots])
        return kvquant.pack(x) if isinstance(x, kvquant.QuantPages) else x
    return pages(k_slots), pages(v_slots)


class TieredStore:
    """Device slots, all-page digests and the stores below: the engine's KV under tiers.

    Owners: `slots` (which page of which layer sits in which slot), `page_to_slot` (the same
    map as an array, for building slot tables), `below` (pages whose current content is stored
    in a tier below; only those may be evicted or prefetched), `stack` / `prefetcher`.
    """

    # Capabilities (callers read these, never the class): one device row per live sequence (its
    # sink and last pages pinned), so a decode batch cannot carry padding rows; runs layer by layer.
    supports_padding = False
    layerwise = True

    def __init__(self, model_cfg: ModelConfig, config: EngineConfig, dtype, mesh=None, *,
                 observer: SelectionObserver | None = None):
        cfg, ec = model_cfg, config
        tc, S = ec.tier, ec.cache.block_size
        self.cfg, self.tc, self.S = cfg, tc, S
        self.num_pages = ec.num_pages
        self.dtype = jnp.dtype(dtype)
        self.quantized = kvquant.is_quantized(self.dtype)
        L = cfg.num_layers
        self.n_slots = tc.device_slots(self.num_pages)
        self.slots = DeviceSlots(L, self.n_slots + 1, reserved=(0,))  # slot 0: null, never written
        shape = (L, cfg.num_kv_heads, self.n_slots + 1, S, cfg.head_dim)
        # On a mesh the slots and digests are sharded by kv head over `model` (as the all-resident
        # pool is), pages cross to the device already split by head (`_page_sharding`), and each
        # shard of heads has its own stores below (`ShardedTierStack`).
        self.mesh = mesh
        pool = None
        self._page_sharding = None
        if self.mesh is not None:
            pool = distributed.pool_sharding(self.mesh)
            # [pages, kv_heads, ...]: float pages, a quantized page's data and its scales alike
            self._page_sharding = NamedSharding(self.mesh, PartitionSpec(None, "model"))
        # zeros: masked reads of unfilled slots stay finite
        if self.quantized:
            k, v = kvquant.zeros(shape, self.dtype), kvquant.zeros(shape, self.dtype)
            if pool is not None:
                k, v = jax.device_put((k, v), pool)
        else:
            k = jnp.zeros(shape, self.dtype, device=pool)
            v = jnp.zeros(shape, self.dtype, device=pool)
        sp = ec.sparse
        dig = None
        if sp.enabled:
            # Digests of quantized keys are kept in float32, as the all-resident pool keeps them.
            ddt = jnp.dtype(sp.digest_dtype or (jnp.float32 if self.quantized else self.dtype))
            dig = page_digests.create(sp.digest, L, cfg.num_kv_heads, self.num_pages, cfg.head_dim, ddt)
            if pool is not None:
                dig = jax.device_put(dig, pool)
        self._kv = DeviceKV(k, v, dig)
        self.page_to_slot = np.zeros((L, self.num_pages), np.int32)
        self.spec = PageSpec(num_layers=L, num_pages=self.num_pages, kv_heads=cfg.num_kv_heads, block_size=S,
                             head_dim=cfg.head_dim, dtype=jnp.dtype(self.dtype).name)
        shards = 1 if self.mesh is None else self.mesh.shape["model"]
        self.stack = TierStack(self.spec, tc) if shards == 1 else ShardedTierStack(self.spec, tc, shards)
        links = Links(tc.link_model, self.spec.page_bytes) if tc.link == "emulate" else None
        self.prefetcher = Prefetcher(self.stack, capacity=tc.staging_pages, workers=tc.io_workers, links=links)
        self.predictor = Predictor(tc, L, block_size=S)
        self.hot = HotZone(tc, L)
        self.below: set = set()
        self.writes = WriteLog(S)  # which calls wrote each page (on_corrupt="recompute" replays them)
        self.fused_steps = 0  # decode steps run as one device program (runtime.fused)
        self.fused_program_seconds = 0.0  # time in those programs (their host callbacks included)
        self.np_dtype = self.spec.np_dtype
        # Research hooks (`tiers.observe.SelectionObserver`), fixed for the store's life.
        observer = observer or SelectionObserver()
        self.selection_log: list | None = observer.log
        self.selection_edit = observer.edit
        # Device scalars made once: creating one per layer per call is a dispatch each time.
        self.layer_ids = [jnp.int32(layer) for layer in range(L)]
        self.windows = [jnp.int32(w) for w in cfg.layer_windows]

    # ---- device arrays (the KVStore interface) ----------------------------------------------------
    @property
    def device(self) -> DeviceKV:
        """The slot arrays and all-page digests (read only: a step replaces them through `update`)."""
        return self._kv

    def update(self, step: Callable[[DeviceKV], tuple]):
        """Run `step(arrays) -> (new arrays, out)`; the new arrays replace the old. Returns `out`."""
        self._kv, out = step(self._kv)
        return out

    @property
    def digest_itemsize(self) -> int:
        return 0 if self._kv.digests is None else self._kv.digests.dtype.itemsize

    def pinned_resident(self, layer: int) -> set:
        """Pages of `layer` that are pinned and sit in a slot."""
        return {p for p in self.slots.pinned_pages(layer) if self.page_to_slot[layer, p] != 0}

    def set_link(self, link) -> None:
        """Time transfers with the `LinkConfig` `link` from now on (None: real links), e.g. to
        measure one prefilled engine across several emulated links."""
        self.prefetcher.set_links(None if link is None else Links(link, self.spec.page_bytes))

    # ---- residency ---------------------------------------------------------------------------
    def forget(self, pages) -> None:
        """Pages (re)allocated by the cache: whatever a slot or a tier holds for them is stale."""
        for p in pages:
            for layer in range(self.cfg.num_layers):
                key = (layer, int(p))
                if self.slots.release(key) is not None:
                    self.page_to_slot[layer, p] = 0
                self.stack.discard(key)
                self.prefetcher.invalidate(key)
                self.below.discard(key)
        self.writes.forget(pages)

    def admit(self, layer: int, pages, *, fetch=True) -> None:
        """Make `pages` of `layer` resident together. Misses are read from below when `fetch` is
        True or (a set) holds the page; the others are fresh pages about to be written."""
        keys = [(layer, int(p)) for p in pages]
        adms = self.slots.ensure(keys)
        missing_keys, missing_slots = [], []
        for a in adms:
            self.place(a)
            if not a.hit and (fetch is True or (fetch is not False and a.key[1] in fetch)):
                missing_keys.append(a.key)
                missing_slots.append(a.slot)
        if missing_keys:
            try:
                self._fill(layer, missing_keys, missing_slots)
            except Exception:
                # Nothing was written into the slots: they must not claim the pages (a retry would
                # take them for hits and read whatever the slots held before).
                for key in missing_keys:
                    self.slots.release(key)
                    self.page_to_slot[key] = 0
                raise

    def place(self, a) -> None:
        """Record an `Admission` in `page_to_slot` (the evicted key, if any, leaves its slot)."""
        if a.evicted is not None:
            self.page_to_slot[a.evicted] = 0
        self.page_to_slot[a.key] = a.slot

    def read_below(self, key):
        """A page the device needs now, from the prefetcher (staged hit or timed miss)."""
        if key not in self.below:
            raise TierError(f"page (layer={key[0]}, page={key[1]}) is needed on device but no tier holds "
                            f"its current content (a partial page must stay pinned: tier.pin_local_pages).")
        page = self.prefetcher.get(key)
        if page is None:  # on_corrupt="recompute": the stack refused a bad page; the runner rebuilds it
            raise PageCorrupt(f"page (layer={key[0]}, page={key[1]}) failed verification below the device and "
                              f"could not be recomputed here.", key)
        return page

    def prefetch(self, keys) -> None:
        """Start fetching the keys (most wanted first) that are stored below and not in a slot."""
        self.prefetcher.schedule(key for key in keys if key in self.below and self.page_to_slot[key] == 0)

    def _to_slots(self, x):
        """Stored pages (numpy [..., row]) -> what slots take (QuantPages when quantized)."""
        return kvquant.unpack(x, self.dtype) if self.quantized else x

    def _to_stored(self, x):
        """Pool-form pages (array or QuantPages [..., D]; float pages into a quantized store are
        quantized, as the pool does) -> numpy as the tiers store them."""
        if not self.quantized:
            return np.asarray(kvquant.read(x, self.dtype) if isinstance(x, kvquant.QuantPages) else x)
        if not isinstance(x, kvquant.QuantPages):
            x = kvquant.quantize(jnp.asarray(x), self.dtype)
        return kvquant.pack(kvquant.to_host(x))

    def _fill(self, layer, keys, slots) -> None:
        ks, vs = [], []
        for key in keys:
            page = self.read_below(key)
            ks.append(page.k)
            vs.append(page.v)
        n = pow2_at_least(len(keys))
        pad = n - len(keys)
        if pad:  # padded slots are out of range: dropped by the scatter
            ks += [ks[0]] * pad
            vs += [vs[0]] * pad
        idx = np.full(n, self.n_slots + 1, np.int32)
        idx[:len(slots)] = slots
        self._fill_slots(layer, idx, np.stack(ks), np.stack(vs))

    def _fill_slots(self, layer, idx, k, v) -> None:
        """Stored pages k, v [n, K, S, row] (numpy) into slots `idx` [n] of `layer`. On a mesh
        each device receives only its heads of the pages."""
        k, v = self._to_slots(k), self._to_slots(v)
        if self._page_sharding is not None:
            k, v = jax.device_put(k, self._page_sharding), jax.device_put(v, self._page_sharding)
        kv = self._kv
        k, v = _fill(kv.k, kv.v, self.layer_ids[layer], idx, k, v)
        self._kv = kv._replace(k=k, v=v)

    def put_below(self, layer: int, pages) -> None:
        """Full pages of `layer` (resident) go down the tiers."""
        pages = [int(p) for p in pages]
        if not pages:
            return
        n = pow2_at_least(len(pages))
        idx = np.zeros(n, np.int32)
        idx[:len(pages)] = self.page_to_slot[layer, pages]
        k, v = _read(self._kv.k, self._kv.v, self.layer_ids[layer], idx)
        k, v = np.asarray(k), np.asarray(v)
        for i, p in enumerate(pages):
            key = (layer, p)
            self.prefetcher.invalidate(key)
            self.stack.put(key, k[i], v[i])
            self.below.add(key)

    # ---- whole pages in and out (sessions: snapshot, restore, rewind) ---------------------------
    def gather(self, pages):
        """Every layer's KV and digests of physical `pages`, wherever each lives -> k, v
        [L, K, n, S, D] (numpy; QuantPages of numpy arrays when quantized, as the all-resident
        pool gives), digests [L, K, n, R, D] or None. The null page reads as zeros; pages from disk
        are verified (IntegrityError names a corrupt one)."""
        cfg, L = self.cfg, self.cfg.num_layers
        pages = [int(p) for p in pages]
        k = np.zeros((L, cfg.num_kv_heads, len(pages), self.S, self.spec.row), self.np_dtype)
        v = np.zeros_like(k)
        for layer in range(L):
            on_device = [(i, p) for i, p in enumerate(pages) if p != 0 and self.page_to_slot[layer, p] != 0]
            if on_device:
                idx = np.asarray([self.page_to_slot[layer, p] for _, p in on_device], np.int32)
                kk, vv = (np.asarray(a) for a in _read(self._kv.k, self._kv.v, self.layer_ids[layer], idx))
                for j, (i, _) in enumerate(on_device):
                    k[layer, :, i], v[layer, :, i] = kk[j], vv[j]
            for i, p in enumerate(pages):
                if p == 0 or self.page_to_slot[layer, p] != 0:
                    continue
                if (layer, p) not in self.below:
                    raise TierError(f"page (layer={layer}, page={p}) is neither on device nor in a tier below.")
                page = self.stack.get((layer, p))
                if page is None:  # on_corrupt="recompute" rebuilds pages a step reads, not pages copied out
                    raise IntegrityError(f"page (layer={layer}, page={p}) failed verification on disk; a snapshot "
                                         f"or rewind cannot copy it (a decode step would have recomputed it).")
                k[layer, :, i], v[layer, :, i] = page.k, page.v
        dig = None if self._kv.digests is None else np.asarray(self._kv.digests[:, :, np.asarray(pages, np.int32)])
        return self._to_slots(k), self._to_slots(v), dig

    def scatter(self, pages, k, v, digests=None, *, partial=()) -> None:  # noqa: PLR0913
        """Write whole pages (physical ids; k, v [L, K, n, S, D], digests [L, K, n, R, D]) into
        the tiers: full pages go below the device (as a filled page would); pages in `partial`
        (not full yet, so never stored below) go into device slots."""
        pages = [int(p) for p in pages]
        partial = {int(p) for p in partial}
        k, v = self._to_stored(k), self._to_stored(v)
        self.forget(pages)  # whatever a slot or a tier held for these ids is stale
        for layer in range(self.cfg.num_layers):
            part = []
            for i, p in enumerate(pages):
                if p in partial:
                    part.append((i, p))
                else:
                    self.stack.put((layer, p), np.asarray(k[layer, :, i]), np.asarray(v[layer, :, i]))
                    self.below.add((layer, p))
            if part:
                self.admit(layer, [p for _, p in part], fetch=False)
                idx = np.asarray([self.page_to_slot[layer, p] for _, p in part], np.int32)
                self._fill_slots(layer, idx, np.stack([np.asarray(k[layer, :, i]) for i, _ in part]),
                                 np.stack([np.asarray(v[layer, :, i]) for i, _ in part]))
        if digests is not None and self._kv.digests is not None:
            dig = self._kv.digests
            self._kv = self._kv._replace(digests=dig.at[:, :, np.asarray(pages, np.int32)].set(
                jnp.asarray(digests, dig.dtype)))

    def scatter_rows(self, pages, rows, digests=None) -> None:
        """`scatter` of full pages given as the prefix store keeps them (`PooledStore.scatter_rows`):
        they go below the device, in the form the tiers store (packed rows when quantized)."""
        k, v = np.moveaxis(rows[:, 0], 0, 2), np.moveaxis(rows[:, 1], 0, 2)
        if self.quantized:
            k, v = kvquant.unpack(k, self.dtype), kvquant.unpack(v, self.dtype)
        self.scatter(pages, k, v, None if digests is None else np.moveaxis(digests, 0, 2))

    def copy_pages(self, src, dst) -> None:
        """Private copies of partial pages `src` at `dst` (a rewind's copy-on-write)."""
        for s, d in zip(src, dst):
            k, v, dig = self.gather([s])
            self.scatter([d], k, v, dig, partial=[d])

    def stats(self) -> dict:
        """Tier counters: device slots, host and disk stores, KV bytes held per tier."""
        held = self.stack.bytes_held()
        kv = self._kv
        per_device = sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves((kv.k, kv.v)))
        out = {"page_bytes": self.spec.page_bytes, "device_slots_per_layer": self.n_slots, "device_hits": self.slots.hits,
               "device_misses": self.slots.misses, "device_evictions": self.slots.evictions,
               "kv_bytes_device": int(kv.k.nbytes + kv.v.nbytes), "kv_bytes_per_device": int(per_device),
               "kv_bytes_host": held["host"], "fused_decode_steps": self.fused_steps,
               "fused_program_seconds": self.fused_program_seconds,
               **self.stack.stats(), **{k: v for k, v in self.prefetcher.stats.items()}}
        if held["disk"] is not None:
            out["kv_bytes_disk"] = held["disk"]
        if kv.digests is not None:
            out["digest_bytes_device"] = int(kv.digests.nbytes)
        return out

    def close(self) -> None:
        self.prefetcher.close()
        self.stack.close()
