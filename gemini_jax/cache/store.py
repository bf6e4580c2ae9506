"""The pooled KV store: the one owner of the all-resident page pool on device.

A KV store owns the device arrays of the cache (`DeviceKV`: K and V pages, page digests). Jitted
steps take them in and hand them back through `update`, which is the only place they are
replaced; sessions, snapshots and benchmarks reach pages through `gather` / `scatter` /
`copy_pages`, never through the arrays. `gemini_jax.tiers.TieredStore` has the same interface
over device slots and the tiers below.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax import distributed
from gemini_jax.attention import digests as page_digests
from gemini_jax.attention import kvquant
from gemini_jax.cache.shapes import pow2_at_least
from gemini_jax.config import EngineConfig, ModelConfig


class DeviceKV(NamedTuple):
    """A store's device arrays (a pytree: jitted steps take it and return it)."""

    k: jax.Array  # [layers, kv_heads, pages (or slots), block_size, head_dim] (or kvquant.QuantPages)
    v: jax.Array
    digests: Optional[jax.Array] = None  # [layers, kv_heads, pages, R, head_dim] (sparse only)


def create_pool(cfg: ModelConfig, num_pages: int, block_size: int, dtype):
    """Zeroed K and V pools: the null page (0) is read under a mask, and 0 * NaN would poison outputs."""
    shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, block_size, cfg.head_dim)
    return kvquant.zeros(shape, dtype), kvquant.zeros(shape, dtype)


@jax.jit
def _copy(kv: DeviceKV, src, dst) -> DeviceKV:
    """Whole pages src[i] -> dst[i] in every layer (copy-on-write of partial pages)."""
    dig = None if kv.digests is None else kv.digests.at[:, :, dst].set(kv.digests[:, :, src])
    at = (slice(None), slice(None), dst)
    return DeviceKV(kvquant.write(kv.k, at, kv.k[:, :, src]), kvquant.write(kv.v, at, kv.v[:, :, src]), dig)


def _set_pages(kv: DeviceKV, idx, k, v, dig) -> DeviceKV:
    at = (slice(None), slice(None), idx)
    digests_ = kv.digests if dig is None else kv.digests.at[at].set(dig.astype(kv.digests.dtype), mode="drop")
    return DeviceKV(kvquant.write(kv.k, at, k, mode="drop"), kvquant.write(kv.v, at, v, mode="drop"), digests_)


@functools.partial(jax.jit, donate_argnums=(0,))
def _scatter(kv: DeviceKV, idx, k, v, dig) -> DeviceKV:
    """Whole pages at physical ids `idx` (ids past the pool are dropped) in every layer."""
    return _set_pages(kv, idx, k, v, dig)


@functools.partial(jax.jit, donate_argnums=(0,), static_argnames=("quant",))
def _scatter_rows(kv: DeviceKV, idx, rows, dig, quant: Optional[str]) -> DeviceKV:
    """`_scatter` of pages in the prefix store's form (`PooledStore.scatter_rows`): the layout is
    changed (and quantized rows unpacked) here, by XLA, rather than by numpy copies on the host."""
    k, v = jnp.moveaxis(rows[:, 0], 0, 2), jnp.moveaxis(rows[:, 1], 0, 2)
    if quant is not None:
        k, v = kvquant.unpack(k, quant), kvquant.unpack(v, quant)
    return _set_pages(kv, idx, k, v, None if dig is None else jnp.moveaxis(dig, 0, 2))


def _pad_pages(x, width: int):
    """Pages [L, K, n, ...] (or kvquant.QuantPages of them) zero-padded to `width` along axis 2."""
    if isinstance(x, kvquant.QuantPages):
        return kvquant.QuantPages(_pad_pages(x.data, width), _pad_pages(x.scale, width))
    x = np.asarray(x)
    if x.shape[2] == width:
        return x
    return np.pad(x, [(0, 0), (0, 0), (0, width - x.shape[2])] + [(0, 0)] * (x.ndim - 3))


ROWS_PIECE = 256  # pages per `scatter_rows` program


@runtime_checkable
class KVStore(Protocol):
    """What a runner, a session and the server ask of a store of device KV; `PooledStore` (below)
    and `gemini_jax.tiers.TieredStore` implement it (`tests/test_architecture.py` checks both
    against it, names and parameters). Callers read the capabilities, never the class:
    `supports_padding` (a decode batch may carry padding rows, which read the null page) and
    `layerwise` (the store runs a call layer by layer from the host, to make each layer's pages
    resident first, instead of as one jitted whole-model step)."""

    supports_padding: bool
    layerwise: bool

    @property
    def device(self) -> DeviceKV:
        """The current device arrays (read only: a step replaces them through `update`)."""

    @property
    def digest_itemsize(self) -> int:
        """Bytes per digest number (0: no digests)."""

    def update(self, step: Callable[[DeviceKV], tuple]):
        """Run `step(arrays) -> (new arrays, out)` on the arrays the store owns; returns `out`."""

    def gather(self, pages):
        """Every layer's KV and digests of physical `pages`, on the host."""

    def scatter(self, pages, k, v, digests=None, *, partial=()) -> None:
        """Write whole pages (physical ids) of every layer."""

    def scatter_rows(self, pages, rows, digests=None) -> None:
        """Write whole pages given in the prefix store's row layout."""

    def copy_pages(self, src, dst) -> None:
        """Private copies of pages `src` at `dst` (a rewind's copy-on-write)."""

    def stats(self) -> dict:
        """The store's own counters (tiers: residency, prefetch, link)."""

    def close(self) -> None:
        """Release what the store holds (threads, files)."""


class PooledStore:
    """Every page of every layer in one device pool (`[layers, kv_heads, num_pages, S, D]`), with
    digests for every page when sparse attention is on. On a mesh the arrays are sharded by kv
    head over `model`."""

    # Capabilities (callers read these, never the class): a decode batch may carry padding rows
    # (they read the null page); runs the whole model as one jitted step.
    supports_padding = True
    layerwise = False

    def __init__(self, model_cfg: ModelConfig, config: EngineConfig, dtype, mesh=None):
        k, v = create_pool(model_cfg, config.num_pages, config.cache.block_size, dtype)
        sp = config.sparse
        dig = None
        if sp.enabled:
            # Digests of quantized keys are kept in float32: they score pages, and are small.
            default = jnp.float32 if kvquant.is_quantized(dtype) else dtype
            dig = page_digests.create(sp.digest, model_cfg.num_layers, model_cfg.num_kv_heads, config.num_pages,
                                 model_cfg.head_dim, jnp.dtype(sp.digest_dtype or default))
        if mesh is not None:
            k, v, dig = jax.device_put((k, v, dig), distributed.pool_sharding(mesh))
        self._kv = DeviceKV(k, v, dig)

    @property
    def device(self) -> DeviceKV:
        """The current arrays (read only: a step replaces them through `update`)."""
        return self._kv

    def update(self, step: Callable[[DeviceKV], tuple]):
        """Run `step(arrays) -> (new arrays, out)`; the new arrays replace the old (which `step`
        may have donated). Returns `out`."""
        self._kv, out = step(self._kv)
        return out

    @property
    def digest_itemsize(self) -> int:
        return 0 if self._kv.digests is None else self._kv.digests.dtype.itemsize

    # ---- whole pages in and out (sessions: snapshot, restore, rewind; benchmarks) --------------
    def gather(self, pages):
        """Every layer's KV and digests of physical `pages` -> numpy k, v [L, K, n, S, D] (as stored:
        kvquant.QuantPages of numpy arrays when quantized), digests [L, K, n, R, D] or None."""
        idx = jnp.asarray(pages, jnp.int32)
        kv = self._kv
        dig = None if kv.digests is None else np.asarray(kv.digests[:, :, idx])
        return kvquant.to_host(kv.k[:, :, idx]), kvquant.to_host(kv.v[:, :, idx]), dig

    def scatter(self, pages, k, v, digests=None, *, partial=()) -> None:
        """Write whole pages (physical ids; k, v [L, K, n, S, D], digests [L, K, n, R, D]).
        `partial` matters to tiered stores only (every page here is on device)."""
        del partial
        # One compiled program per power-of-two page count (padding goes to an out-of-range page and
        # is dropped), the pool donated: no compile per call, no copy of the pool.
        n = len(pages)
        width = pow2_at_least(max(n, 1))
        idx = np.full(width, self._kv.k.shape[2], np.int32)  # past the last page: dropped
        idx[:n] = np.asarray(pages, np.int32)
        pad = functools.partial(_pad_pages, width=width)
        dig = None if self._kv.digests is None or digests is None else pad(digests)
        self._kv = _scatter(self._kv, jnp.asarray(idx), pad(k), pad(v), dig)

    def scatter_rows(self, pages, rows, digests=None) -> None:
        """Write whole pages given as the prefix store keeps them: `rows` [n, 2 (k, v), L, K, S, row]
        (row: head_dim numbers, or a quantized vector's bytes and scale, `kvquant.pack`), digests
        [n, L, K, R, D]. Same result as `scatter` of the pages laid out [L, K, n, ...].
        NOTE: a long prefix is hundreds of MB; a host-side transpose or pad of it costs more than
        reading it from disk (each copy faults in fresh memory). So the rows go in pieces of at most
        ROWS_PIECE pages sliced along their leading axis (no host copy), only the last piece
        padded, and XLA lays them out: one compiled program per piece width."""
        quant = self._kv.k.dtype.name if isinstance(self._kv.k, kvquant.QuantPages) else None
        pages = np.asarray(pages, np.int32)
        n = len(pages)
        for a in range(0, n, ROWS_PIECE):
            m = min(n, a + ROWS_PIECE) - a
            width = pow2_at_least(m)
            idx = np.full(width, self._kv.k.shape[2], np.int32)  # past the last page: dropped
            idx[:m] = pages[a:a + m]
            part = [rows[a:a + m], None if digests is None or self._kv.digests is None else digests[a:a + m]]
            if width > m:
                part = [None if x is None else np.pad(x, [(0, width - m)] + [(0, 0)] * (x.ndim - 1)) for x in part]
            self._kv = _scatter_rows(self._kv, jnp.asarray(idx), *part, quant=quant)

    def copy_pages(self, src, dst) -> None:
        """Private copies of pages `src` at `dst` (a rewind's copy-on-write)."""
        self._kv = _copy(self._kv, jnp.asarray(src, jnp.int32), jnp.asarray(dst, jnp.int32))

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass
