"""Quantized KV: int8 or float8 (e4m3) vectors with one float32 scale per vector.

A vector is one token's key (or value) in one kv head: `head_dim` numbers. Each is stored as
`round(x / scale)` in int8 (or `x / scale` cast to float8_e4m3fn, held as its bytes: see
`STORAGE`), with `scale = max|x| / QMAX`,
and read back as `data * scale` in float32. The scale is per token, not per page, because a
page fills one decode step at a time: a page-wide scale would have to grow as larger keys
arrive, re-rounding every key already in the page; a token's scale never changes once written,
so a page holds the same bytes however it was filled (prefill chunk or decode steps), and the
paged and contiguous caches hold the same numbers (docs/architecture.md §6 within a quantized dtype).

Cost: head_dim bytes + 4 per vector, i.e. (D + 4) / (4 D) of float32 (0.266 at D = 64).

`QuantPages` carries data and scales together as one pytree, so pools, block gathers and
snapshots move them as one value: indexing over leading axes (layer, kv head, page, slot)
indexes both. Code reading KV calls `read(x, dtype)`, which is a plain `astype` for float pools.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax.config import KV_QUANT_DTYPES as QUANT_DTYPES

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
SCALE_DTYPE = jnp.float32
# How each format is held in memory. float8 values are kept as their bytes (uint8): XLA's CPU
# backend gathers and slices float8 arrays several times slower than 8-bit integers inside the
# decode loop, and converts them in software; a 256-entry table reads the bytes back instead.
STORAGE = {"int8": "int8", "float8_e4m3fn": "uint8"}
FORMAT_OF = {v: k for k, v in STORAGE.items()}
_E4M3 = np.arange(256, dtype=np.uint8).view(jnp.float8_e4m3fn).astype(np.float32)  # value of each byte


def is_quantized(dtype) -> bool:
    return np.dtype(dtype).name in QUANT_DTYPES


@jax.tree_util.register_pytree_node_class
class QuantPages:
    """Quantized vectors `data` [..., D] (int8, or float8 held as uint8 bytes) and their scales
    `scale` [...] (float32). Works over jax and numpy arrays alike (a snapshot's image holds numpy
    ones)."""

    def __init__(self, data, scale):
        self.data, self.scale = data, scale

    def tree_flatten(self):
        return (self.data, self.scale), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(*children)

    @property
    def shape(self):
        return self.data.shape

    @property
    def dtype(self):
        """The stored format (float8 data is held as its bytes, uint8: see `STORAGE`)."""
        return np.dtype(FORMAT_OF[np.dtype(self.data.dtype).name])

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + self.scale.nbytes)

    def __getitem__(self, idx):
        # Indices address leading axes only, so the scale (one axis fewer) indexes alike.
        return QuantPages(self.data[idx], self.scale[idx])

    def __repr__(self):
        return f"QuantPages({self.data.dtype}{list(self.data.shape)})"


def zeros(shape, dtype) -> Any:
    """A zeroed pool of `shape` [..., D] in `dtype`: float dtypes as a plain array, quantized ones
    as QuantPages (data 0, scale 0: reads back as 0.0, never NaN under a mask)."""
    if not is_quantized(dtype):
        return jnp.zeros(shape, dtype)
    return QuantPages(jnp.zeros(shape, STORAGE[np.dtype(dtype).name]), jnp.zeros(shape[:-1], SCALE_DTYPE))


def quantize(x, dtype) -> QuantPages:
    """Float vectors x [..., D] -> QuantPages in `dtype` (per-vector absmax scale)."""
    name = np.dtype(dtype).name
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1)
    scale = jnp.where(amax > 0, amax / QMAX[name], 1.0).astype(SCALE_DTYPE)
    y = xf / scale[..., None]
    if name == "int8":
        return QuantPages(jnp.clip(jnp.round(y), -QMAX[name], QMAX[name]).astype(jnp.int8), scale)
    return QuantPages(jax.lax.bitcast_convert_type(y.astype(jnp.float8_e4m3fn), jnp.uint8), scale)


def _values(data):
    if data.dtype == jnp.uint8:  # float8_e4m3fn bytes
        return jnp.take(jnp.asarray(_E4M3), data.astype(jnp.int32))
    return data.astype(jnp.float32)


def read(x, dtype):
    """Stored KV (a float array or QuantPages) as `dtype` numbers."""
    if isinstance(x, QuantPages):
        return (_values(x.data) * x.scale[..., None].astype(jnp.float32)).astype(dtype)
    return x.astype(dtype)


def kernel_operands(x):
    """Stored KV as the Pallas kernels take it: (numbers, scales). Float pages -> (x, None);
    QuantPages -> (int8 or float8_e4m3fn numbers, f32 scales), float8 bytes bitcast back to
    their format (free: the same bits)."""
    if not isinstance(x, QuantPages):
        return x, None
    data = x.data
    if data.dtype == jnp.uint8:
        data = jax.lax.bitcast_convert_type(data, jnp.float8_e4m3fn)
    return data, x.scale


def write(pool, idx, values, mode: str | None = None):
    """`pool` with `values` set at `idx` (`pool.at[idx].set`): float values into a quantized pool are
    quantized first; QuantPages values (copied pages, a restored image) are set as they are."""
    if not isinstance(pool, QuantPages):
        return pool.at[idx].set(jnp.asarray(read(values, pool.dtype) if isinstance(values, QuantPages) else values,
                                            pool.dtype), mode=mode)
    if not isinstance(values, QuantPages):
        values = quantize(jnp.asarray(values), pool.dtype)
    return QuantPages(pool.data.at[idx].set(jnp.asarray(values.data, pool.data.dtype), mode=mode),
                      pool.scale.at[idx].set(jnp.asarray(values.scale, SCALE_DTYPE), mode=mode))


def to_host(x):
    """Device KV (array or QuantPages) -> numpy (QuantPages of numpy arrays)."""
    if isinstance(x, QuantPages):
        return QuantPages(np.asarray(x.data), np.asarray(x.scale))
    return np.asarray(x)


SCALE_BYTES = 4  # one float32 scale per vector


def pack(x: QuantPages):
    """QuantPages [..., D] -> uint8 [..., D + 4]: each vector's bytes, then its scale's (little
    endian). The tiers store and move this form: a page is one plain byte array, checksummed and
    written as one. numpy in, numpy out; jax in, jax out (inside a jitted step too)."""
    if isinstance(x.data, np.ndarray):
        scale = np.ascontiguousarray(x.scale, "<f4").view(np.uint8).reshape(*x.scale.shape, SCALE_BYTES)
        return np.concatenate([x.data.view(np.uint8), scale], axis=-1)
    scale = jax.lax.bitcast_convert_type(x.scale.astype(jnp.float32), jnp.uint8)  # [..., 4]
    return jnp.concatenate([jax.lax.bitcast_convert_type(x.data, jnp.uint8), scale], axis=-1)


def unpack(x, dtype) -> QuantPages:
    """uint8 [..., D + 4] (`pack`'s form) -> QuantPages [..., D] in `dtype` (int8 | float8_e4m3fn)."""
    store = STORAGE[np.dtype(dtype).name]
    if isinstance(x, np.ndarray):
        data = x[..., :-SCALE_BYTES].view(np.dtype(store))
        return QuantPages(data, np.ascontiguousarray(x[..., -SCALE_BYTES:]).view("<f4")[..., 0].astype(np.float32))
    data = x[..., :-SCALE_BYTES]
    if store == "int8":
        data = jax.lax.bitcast_convert_type(data, jnp.int8)
    return QuantPages(data, jax.lax.bitcast_convert_type(x[..., -SCALE_BYTES:], jnp.float32))


def vector_bytes(dtype, head_dim: int) -> int:
    """Bytes one stored vector (a token's K or V in one kv head) takes, its scale included."""
    return head_dim * np.dtype(dtype).itemsize + (SCALE_BYTES if is_quantized(dtype) else 0)
