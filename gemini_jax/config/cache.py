"""The KV cache: kind, page size, stored dtype, syntax-aligned pages (`CacheConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

from gemini_jax.config.base import require
from gemini_jax.config.model import Dtype

# KV stored quantized, one float32 scale per token and kv head (gemini_jax.attention.kvquant).
KvQuantDtype = Literal["int8", "float8_e4m3fn"]
KV_QUANT_DTYPES = get_args(KvQuantDtype)
CacheDtype = Literal[Dtype, KvQuantDtype]
CacheKind = Literal["contiguous", "paged"]
AlignMode = Literal["none", "syntax"]
ALIGN_MODES = get_args(AlignMode)


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The KV cache.

    kind "contiguous": the dense reference, one [max_seq_len] buffer per sequence.
    kind "paged": a pool of `num_pages` pages of `block_size` tokens (page 0 is a reserved null
    page); None sizes the pool for max_batch full-length sequences. `prefix_caching` lets a new
    request reuse cached full pages of an identical prefix.

    dtype: how K and V are stored. A float dtype (None: the model's), or "int8" / "float8_e4m3fn":
    each token's K and V in each kv head quantized with its own float32 scale (absmax), read back
    in the model's dtype (gemini_jax.attention.kvquant). Quantized KV runs wherever float KV does:
    the XLA path and the Pallas decode kernels (they read numbers and scales), the contiguous and
    paged caches, sparse or not, over tiers (pages go down packed with their scales) or a mesh
    (scales sharded by kv head with their data), the persistent prefix store (keyed on the dtype),
    sessions and snapshots.

    align: "none" (pages are fixed token spans) or "syntax": the prompt is read as source code in
    `align_language` (token ids 0-255 as bytes: a byte-level model) and a new page starts at each
    definition (function or class) inside at most `align_depth` other definitions (0: top-level ones;
    1: the methods of top-level classes too), the rest of the page before it left as padding that
    attention, digests and selection mask. A page then never spans two definitions. Rope keeps the
    tokens' true positions, so the numbers are those of fixed pages (exact up to rounding); the
    padding costs slots (and `max_seq_len` counts them). Supported on the paged cache, XLA
    attention, dense or sparse with true positions, one device, full-attention models, through
    `Engine.generate` / `score`; every other combination is refused by name
    (`gemini_jax.config.compat`).
    """

    kind: CacheKind = "paged"
    block_size: int = 16
    num_pages: Optional[int] = None
    dtype: Optional[CacheDtype] = None  # None: the model's dtype
    prefix_caching: bool = True
    align: AlignMode = "none"
    align_language: str = "python"
    align_depth: int = 0

    def __post_init__(self):
        require(self.kind in get_args(CacheKind),
                 f"cache.kind={self.kind!r} must be 'contiguous' or 'paged'.")
        bs = self.block_size
        require(isinstance(bs, int) and 8 <= bs <= 256 and bs & (bs - 1) == 0,
                 f"cache.block_size={bs!r} must be a power of two in [8, 256].")
        require(self.num_pages is None or (isinstance(self.num_pages, int) and self.num_pages >= 2),
                 f"cache.num_pages={self.num_pages!r} must be None or an integer >= 2.")
        require(self.dtype is None or self.dtype in get_args(CacheDtype),
                 f"cache.dtype={self.dtype!r} must be None or one of {get_args(CacheDtype)}.")
        require(self.align in ALIGN_MODES, f"cache.align={self.align!r} must be one of {ALIGN_MODES}.")
        require(isinstance(self.align_depth, int) and not isinstance(self.align_depth, bool) and self.align_depth >= 0,
                 f"cache.align_depth={self.align_depth!r} must be an integer >= 0 (0: top-level definitions only; "
                 f"1: methods too).")
        require(self.align == "none" or self.kind == "paged",
                 f"cache.align={self.align!r} lays out pages: it needs cache.kind='paged' (got {self.kind!r}).")

    @property
    def quantized(self) -> bool:
        return self.dtype in KV_QUANT_DTYPES
