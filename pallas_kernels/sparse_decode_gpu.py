"""Sparse paged decode attention for NVIDIA GPUs: the Pallas Triton backend.

Same inputs and semantics as `sparse_decode.sparse_decode_attention` (and its reference): each
(sequence, kv head) attends to the logical pages `selected[b, h]` lists. The walk is the dense
GPU kernel's (`paged_decode_gpu`), over selection slots instead of logical pages:

- the wrapper packs each (b, h)'s selection (entries naming a page with no visible key dropped,
  the rest sorted to the front and counted; `decode_common.pack_selection`) and looks the packed
  pages up in the block table. Both are tiny int32 ops that never touch the pool.
- grid `(batch, kv_head, split)`; a program owns one (b, h), its whole query-head group and one
  of `k_splits` ranges of slots; it loops over `pages_per_step` slots at a time, up to the
  (b, h)'s count only, gathering those pages with one vector load (masked per key: partial
  pages, keys before the window).
- per-split (acc, max, sum) merged by log-sum-exp outside the kernel (`merge_splits`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_common import check_sparse_inputs, pack_selection, visible_pages
from pallas_kernels.paged_decode_gpu import (MIN_DOT_DIM, attend_pages_step, check_gpu_knobs,
                                             default_k_splits, default_pages_per_step, init_carry,
                                             merge_splits, next_pow2, pad_queries,
                                             split_k_call)


def _sparse_decode_gpu_kernel(
    lengths_ref,  # i32[B]
    counts_ref,  # i32[B, Hkv] usable slots per (b, h)
    logical_ref,  # i32[B, Hkv, K] packed selected logical pages
    physical_ref,  # i32[B, Hkv, K] their physical pages
    q_ref,  # [Gp, Dp]
    *refs,  # k_ref, v_ref [P, S, D] this kv head's pool (+ k, v scale refs [P, S] when
    #          quantized), then o_ref, m_ref, l_ref as `_paged_decode_gpu_kernel`'s
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_step: int,
    slots_per_split: int,
    pages_per_seq: int,
):
    pools, (o_ref, m_ref, l_ref) = refs[:-3], refs[-3:]
    k_ref = pools[0]
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    n = pages_per_step
    length = lengths_ref[b]
    first_key, _, _ = visible_pages(length, page_size=k_ref.shape[1], pages_per_seq=pages_per_seq,
                                    sliding_window=sliding_window)
    # This split's usable slots: [lo, hi); every one names a page with a visible key.
    lo = split * slots_per_split
    hi = jnp.minimum(lo + slots_per_split, counts_ref[b, h])
    q = q_ref[...]

    def body(i, carry):
        start = lo + i * n
        page_ok = start + lax.broadcasted_iota(jnp.int32, (n,), 0) < hi
        logical = plgpu.load(logical_ref.at[b, h, pl.ds(start, n)], mask=page_ok, other=0)
        physical = plgpu.load(physical_ref.at[b, h, pl.ds(start, n)], mask=page_ok, other=0)
        return attend_pages_step(carry, q, pools, physical, logical, page_ok,
                                 length=length, first_key=first_key, sm_scale=sm_scale,
                                 soft_cap=soft_cap)

    num_steps = pl.cdiv(jnp.maximum(hi - lo, 0), n)
    m, l, acc = lax.fori_loop(0, num_steps, body, init_carry(*q_ref.shape))
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(
    jax.jit,
    static_argnames=["sm_scale", "soft_cap", "sliding_window", "pages_per_step", "k_splits",
                     "num_warps", "num_stages", "interpret"],
)
def sparse_decode_attention_gpu(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    selected: jax.Array,  # i32[B, Hkv, K]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_step: int | None = None,
    k_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:  # [B, Hq, D], q.dtype
    """`sparse_decode_attention` (same semantics, arguments and ValueErrors) as a Triton kernel.

    Knobs as `paged_decode_attention_gpu`'s, counted in selection slots instead of pages.
    """
    scales = () if k_scales is None and v_scales is None else (k_scales, v_scales)
    check_sparse_inputs(q, k_pages, v_pages, block_tables, lengths, selected, sm_scale=sm_scale,
                        soft_cap=soft_cap, sliding_window=sliding_window, scales=scales or None)
    check_gpu_knobs(pages_per_step=pages_per_step, k_splits=k_splits, num_warps=num_warps,
                    num_stages=num_stages)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    num_slots = selected.shape[2]
    n = pages_per_step or default_pages_per_step(page_size)
    n = max(n, MIN_DOT_DIM // next_pow2(page_size))  # n * Sp keys >= 16 for the dot
    splits = k_splits or default_k_splits(batch, num_kv_heads, pl.cdiv(num_slots, n))
    splits = min(splits, num_slots)
    slots_per_split = pl.cdiv(num_slots, splits)
    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "cuda", "rocm")

    logical, counts = pack_selection(selected, lengths, page_size=page_size,
                                     pages_per_seq=pages_per_seq, sliding_window=sliding_window)
    # Packed entries are in-range block-table columns (padding is column 0), so this lookup
    # stays in range; the physical ids of padding slots are never used.
    physical = jnp.take_along_axis(block_tables[:, None, :], logical, axis=2)

    q_blocks = pad_queries(q, num_kv_heads)  # [B, Hkv, Gp, Dp]
    kernel = functools.partial(
        _sparse_decode_gpu_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, pages_per_step=n, slots_per_split=slots_per_split,
        pages_per_seq=pages_per_seq)
    o, m, l = split_k_call(kernel, [lengths, counts, logical, physical], q_blocks, k_pages,
                           v_pages, splits=splits, num_warps=num_warps, num_stages=num_stages,
                           interpret=interpret, name=f"sparse_decode_gpu_{page_size=}_{n=}",
                           scales=scales)
    return merge_splits(o, m, l, group=num_q_heads // num_kv_heads, head_dim=head_dim,
                        dtype=q.dtype)
