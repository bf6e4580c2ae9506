"""The unit the tiers move: one KV page of one layer, all kv heads.

`PageKey` = (layer, page_id): page ids are the cache's page ids (`BlockPool`), which name a page
wherever it lives. A page's data is k and v, each `[kv_heads, block_size, head_dim]` (one page of
the device pool `[layers, kv_heads, pages, block_size, head_dim]` at [layer, :, page]); stores
keep them stacked as `[2, kv_heads, block_size, row]` (k first).

A float page's row is its `head_dim` numbers. A quantized page (int8 / float8_e4m3fn: one float32
scale per vector, `gemini_jax.attention.kvquant`) is held packed, `kvquant.pack`: a row is the
vector's `head_dim` bytes then its scale's 4 (uint8 [..., head_dim + 4]), so below the device a
page is one byte array whatever its format, checksummed, stored and moved as one.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from gemini_jax.errors import ConfigError

PageKey = tuple[int, int]  # (layer, page_id)

# The dtype a store holds for each KV format (quantized ones: their packed bytes).
_NP_DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
              "bfloat16": np.dtype(ml_dtypes.bfloat16), "int8": np.dtype(np.uint8),
              "float8_e4m3fn": np.dtype(np.uint8)}
_SCALE_BYTES = 4  # kvquant.SCALE_BYTES (tiers sit below the attention layer: not imported)


@dataclass(frozen=True, kw_only=True)
class PageSpec:
    """Shape of the page space a store serves: `num_layers` x `num_pages` pages of
    `[kv_heads, block_size, head_dim]` in `dtype` ("float32" | "bfloat16" | "float16", or "int8" |
    "float8_e4m3fn" held packed: see the module doc)."""

    num_layers: int
    num_pages: int
    kv_heads: int
    block_size: int
    head_dim: int
    dtype: str = "float32"

    def __post_init__(self):
        for name in ("num_layers", "num_pages", "kv_heads", "block_size", "head_dim"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v >= 1):
                raise ConfigError(f"PageSpec.{name}={v!r} must be an integer >= 1.")
        if self.dtype not in _NP_DTYPES:
            raise ConfigError(f"PageSpec.dtype={self.dtype!r} must be one of {tuple(_NP_DTYPES)}.")

    @property
    def quantized(self) -> bool:
        return self.dtype in ("int8", "float8_e4m3fn")

    @property
    def np_dtype(self) -> np.dtype:
        """What the stores hold (uint8 for a quantized format's packed bytes)."""
        return _NP_DTYPES[self.dtype]

    @property
    def row(self) -> int:
        """Numbers per stored vector: head_dim, + the 4 scale bytes when quantized."""
        return self.head_dim + (_SCALE_BYTES if self.quantized else 0)

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """Shape of k (and of v) as stored: [kv_heads, block_size, row]."""
        return (self.kv_heads, self.block_size, self.row)

    @property
    def page_bytes(self) -> int:
        """Bytes of one (layer, page) unit, k and v together (scales included)."""
        return 2 * self.kv_heads * self.block_size * self.row * self.np_dtype.itemsize

    def check_key(self, key: PageKey) -> PageKey:
        layer, page = int(key[0]), int(key[1])
        if not (0 <= layer < self.num_layers and 0 <= page < self.num_pages):
            raise KeyError(f"page key (layer={layer}, page={page}) outside layers [0, {self.num_layers}) "
                           f"x pages [0, {self.num_pages}).")
        return layer, page

    def stack(self, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """k, v [kv_heads, block_size, row] -> a fresh [2, kv_heads, block_size, row] array in the
        spec's stored dtype (a copy: the caller may reuse its buffers)."""
        k, v = np.asarray(k), np.asarray(v)
        if k.shape != self.page_shape or v.shape != self.page_shape:
            raise ValueError(f"page k{k.shape} / v{v.shape} must both be {self.page_shape} "
                             f"[kv_heads, block_size, head_dim (+ 4 scale bytes when quantized)].")
        if k.dtype != self.np_dtype or v.dtype != self.np_dtype:
            raise ValueError(f"page dtype k={k.dtype} v={v.dtype} must be {self.np_dtype} (what a {self.dtype} store "
                             f"holds); "
                             f"cast before storing so round trips stay bit-exact.")
        out = np.empty((2, *self.page_shape), self.np_dtype)
        out[0], out[1] = k, v
        return out


    def check_stacked(self, data: np.ndarray) -> np.ndarray:
        """Refuse a stacked page of the wrong shape or dtype (numpy would broadcast it silently)."""
        want = (2, *self.page_shape)
        if getattr(data, "shape", None) != want or data.dtype != self.np_dtype:
            raise ValueError(f"stacked page {getattr(data, 'shape', None)} {getattr(data, 'dtype', None)} must be "
                             f"{want} [k/v, kv_heads, block_size, head_dim (+ 4 scale bytes when quantized)] "
                             f"of {self.np_dtype}.")
        return data


def page_digest(key: PageKey, data: np.ndarray) -> bytes:
    """16-byte blake2b of a page's bytes and its key, so a page stored at the wrong place fails
    verification as surely as a page with flipped bits."""
    h = hashlib.blake2b(digest_size=16, person=b"gj-kv-page")
    h.update(int(key[0]).to_bytes(4, "little") + int(key[1]).to_bytes(8, "little"))
    h.update(np.ascontiguousarray(data).view(np.uint8).data)
    return h.digest()
