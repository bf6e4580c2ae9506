"""What the decode kernels share, TPU and GPU variants alike: input validation, the visible span
of a sequence, the packing of a sparse selection, and which kernel variant a call runs.

One module so that every variant validates and masks the same way (and so that a kernel file
can pick its GPU sibling without an import cycle).
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

PLATFORMS = (None, "tpu", "gpu")
# Quantized pages: int8 or float8 (e4m3) numbers with one float32 scale per token and kv head
# (`k_scales`, `v_scales` [num_kv_heads, num_pages, page_size]); a key reads back as k * scale.
QUANT_DTYPES = (jnp.dtype(jnp.int8), jnp.dtype(jnp.float8_e4m3fn))


def dequantize(x, scale):
    """Stored numbers [..., D] (float, or quantized with `scale` [...]) as float32."""
    x = x.astype(jnp.float32)
    return x if scale is None else x * scale.astype(jnp.float32)[..., None]


def kernel_platform(platform: str | None) -> str:
    """The kernel variant a call runs: "tpu", "gpu", or "cpu" (today's TPU kernel in interpret
    mode). `platform=None` follows the running backend (cuda / rocm count as gpu)."""
    if platform not in PLATFORMS:
        raise ValueError(f"{platform=} must be one of {PLATFORMS}.")
    if platform is not None:
        return platform
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


def visible_pages(length, *, page_size: int, pages_per_seq: int, sliding_window: int | None):
    """(first visible key, first visible logical page, last used logical page) of one sequence.

    The query at `length - 1` sees keys `max(length - W, 0) <= k < length`. `last_page` is -1
    for an empty sequence. Every page in `[first_page, last_page]` holds at least one visible key.
    """
    first_key = 0 if sliding_window is None else jnp.maximum(length - sliding_window, 0)
    last_page = jnp.minimum(pl.cdiv(length, page_size), pages_per_seq) - 1
    return first_key, first_key // page_size, last_page


def check_inputs(q, k_pages, v_pages, block_tables, lengths, *, sm_scale, soft_cap,
                 sliding_window, scales=None):
    """Static checks shared by every dense kernel and the reference; raises ValueError naming
    the field. `scales`: (k_scales, v_scales) of quantized pages, or None (pages in q's dtype)."""
    if q.ndim != 3:
        raise ValueError(f"{q.shape=} must be 3-D [batch, num_q_heads, head_dim].")
    if k_pages.ndim != 4:
        raise ValueError(
            f"{k_pages.shape=} must be 4-D [num_kv_heads, num_pages, page_size, head_dim].")
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"{v_pages.shape=} must equal {k_pages.shape=}.")
    if block_tables.ndim != 2:
        raise ValueError(f"{block_tables.shape=} must be 2-D [batch, pages_per_seq].")
    if lengths.ndim != 1:
        raise ValueError(f"{lengths.shape=} must be 1-D [batch].")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"{q.dtype=} must be a floating dtype.")
    if scales is None and (k_pages.dtype != q.dtype or v_pages.dtype != q.dtype):
        raise ValueError(f"{k_pages.dtype=} and {v_pages.dtype=} must equal {q.dtype=} (quantized pages "
                         f"come with k_scales and v_scales).")
    if scales is not None:
        k_scales, v_scales = scales
        if (k_scales is None) != (v_scales is None):
            raise ValueError("k_scales and v_scales come together (or neither: float pages).")
        if k_pages.dtype not in QUANT_DTYPES or v_pages.dtype != k_pages.dtype:
            raise ValueError(f"{k_pages.dtype=} and {v_pages.dtype=} must both be one of "
                             f"{[d.name for d in QUANT_DTYPES]} when scales are given.")
        for name, sc in (("k_scales", k_scales), ("v_scales", v_scales)):
            if sc.shape != k_pages.shape[:-1] or sc.dtype != jnp.float32:
                raise ValueError(f"{name} {sc.shape} {sc.dtype} must be float32 {k_pages.shape[:-1]} "
                                 f"[num_kv_heads, num_pages, page_size]: one scale per stored vector.")
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"{block_tables.dtype=} must be int32.")
    if lengths.dtype != jnp.int32:
        raise ValueError(f"{lengths.dtype=} must be int32.")
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, page_size, head_dim_kv = k_pages.shape
    if min(num_kv_heads, num_pages, page_size, head_dim_kv) < 1:
        raise ValueError(f"{k_pages.shape=} must have no empty dimension.")
    if head_dim_kv != head_dim:
        raise ValueError(f"{k_pages.shape=} head_dim must equal {q.shape=} head_dim.")
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"{num_q_heads=} must be a multiple of {num_kv_heads=} (grouped-query attention).")
    if block_tables.shape[0] != batch or lengths.shape[0] != batch:
        raise ValueError(f"{block_tables.shape=} and {lengths.shape=} must lead with {batch=}.")
    pages_per_seq = block_tables.shape[1]
    if pages_per_seq < 1:
        raise ValueError(f"{pages_per_seq=} must be >= 1.")
    if pages_per_seq * page_size >= 2**31:
        raise ValueError(
            f"{pages_per_seq=} * {page_size=} must fit in int32 (token positions are int32).")
    if not isinstance(sm_scale, numbers.Real) or not sm_scale > 0:
        raise ValueError(f"{sm_scale=} must be a positive Python number (it is static).")
    if soft_cap is not None and not (isinstance(soft_cap, numbers.Real) and soft_cap > 0):
        raise ValueError(f"{soft_cap=} must be None or a positive Python number.")
    if sliding_window is not None and not (
            isinstance(sliding_window, numbers.Integral) and sliding_window >= 1):
        raise ValueError(f"{sliding_window=} must be None or an int >= 1.")


def check_sparse_inputs(q, k_pages, v_pages, block_tables, lengths, selected, *, sm_scale,
                        soft_cap, sliding_window, scales=None):
    """`check_inputs` plus the selection's; raises ValueError naming the field."""
    check_inputs(q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale,
                 soft_cap=soft_cap, sliding_window=sliding_window, scales=scales)
    if selected.ndim != 3:
        raise ValueError(f"{selected.shape=} must be 3-D [batch, num_kv_heads, num_slots].")
    if selected.dtype != jnp.int32:
        raise ValueError(f"{selected.dtype=} must be int32.")
    batch, num_kv_heads = q.shape[0], k_pages.shape[0]
    if selected.shape[:2] != (batch, num_kv_heads):
        raise ValueError(
            f"{selected.shape=} must lead with ({batch=}, {num_kv_heads=}) from q and k_pages.")
    if selected.shape[2] < 1:
        raise ValueError(f"{selected.shape=} must have at least one slot (pad with -1).")


def visible_selection(selected, lengths, *, page_size, pages_per_seq, sliding_window):
    """bool[B, Hkv, K]: which selected entries name a page holding a key visible to the query.
    Padding (-1) and entries past the last used page or outside the block table are False."""
    _, first_page, last_page = visible_pages(lengths, page_size=page_size,
                                             pages_per_seq=pages_per_seq,
                                             sliding_window=sliding_window)
    # (first_page is a Python 0 without a window; reshape broadcasts either way.)
    first_page, last_page = jnp.reshape(first_page, (-1, 1, 1)), last_page[:, None, None]
    return (selected >= first_page) & (selected <= last_page)


def pack_selection(selected, lengths, *, page_size, pages_per_seq, sliding_window):
    """(packed i32[B, Hkv, K], counts i32[B, Hkv]): each (b, h)'s usable entries (naming a page
    with a visible key) sorted to the front, padding set to column 0; `counts` of them.

    NOTE: sorting (rather than trusting the ascending order) keeps "slot j < count names a
    visible page" true for any values, so a bad entry never becomes an out-of-range table lookup
    or page read. It is a tiny op on the int32 selection; it never touches the pool.
    """
    usable = visible_selection(selected, lengths, page_size=page_size,
                               pages_per_seq=pages_per_seq, sliding_window=sliding_window)
    packed = jnp.sort(jnp.where(usable, selected, pages_per_seq), axis=-1)
    packed = jnp.where(packed < pages_per_seq, packed, 0)  # padding: any in-range column
    return packed, usable.sum(axis=-1, dtype=jnp.int32)
