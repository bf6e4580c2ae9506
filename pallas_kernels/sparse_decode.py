"""Sparse paged decode attention: one new query token per sequence against a chosen subset of its
pages, chosen separately for each kv head.

Same pool layout and masking as `paged_decode` (pages `[kv_heads, num_pages, page_size,
head_dim]`, block table `i32[batch, pages_per_seq]`, `lengths i32[batch]` with the query at
position `lengths[b] - 1`), plus `selected i32[batch, kv_heads, num_slots]`: for each (sequence,
kv head) the logical pages to attend to, ascending, padded at the end with -1. Every query head of
a kv head's group shares that kv head's selection. When `selected[b, h]` lists every used logical
page of sequence b (0 .. ceil(lengths[b] / page_size) - 1, in any number of slots), the result is
exactly `paged_decode_attention`'s.

How the kernel walks the pool:

- the wrapper packs each (b, h)'s selection: entries naming a page with no visible key (padding,
  pages past the sequence's last used page or wholly before its sliding window, anything outside
  the block table) are dropped, the rest sorted to the front, and counted. That is a tiny jnp op on
  the int32 selection; it never touches the block table or the pool.
- grid `(batch, kv_head, slot)`; one step sees one selected page of one sequence for one kv head,
  and all `G = num_q_heads // num_kv_heads` query heads of that group.
- `lengths`, `block_tables`, the packed selection and the counts are scalar-prefetched
  (`pltpu.PrefetchScalarGridSpec`); the K/V index map of slot j reads
  `block_tables[b, packed[b, h, j]]` and fetches exactly that physical page. Slots past the count
  re-point at the last selected page (on TPU an unchanged block index issues no new copy) and skip
  their compute with `pl.when`. So only selected pages with a visible key are ever read, and only
  their block-table entries are ever used: every other entry may hold anything.
- online softmax in float32 (running max, running sum, accumulator in scratch), written out at
  the last slot.

Backends: as for `paged_decode` (interpret mode on CPU; compiled on TPU, where this path has not
been run yet; on a GPU backend, or with `platform="gpu"`, the Triton variant in
`sparse_decode_gpu`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.decode_common import (check_sparse_inputs, dequantize, kernel_platform,
                                          pack_selection, visible_pages, visible_selection)
from pallas_kernels.sparse_decode_gpu import sparse_decode_attention_gpu


def _slot_index_map(b, h, j, lengths_ref, block_tables_ref, packed_ref, counts_ref, *,
                    num_kv_heads, num_slots):
    """Block index of slot (b, h, j): the physical page of its selected logical page. Slots past
    the count re-point at the last selected page, so that they issue no new copy."""
    del lengths_ref
    row = b * num_kv_heads + h
    count = counts_ref[row]
    slot = jnp.minimum(j, jnp.maximum(count - 1, 0))
    # NOTE: packed entries are always valid block-table columns (padding is packed as 0), so the
    # lookup below stays in range; a (b, h) with nothing selected points at physical page 0,
    # which always exists, and its compute is skipped.
    physical = jnp.where(count > 0, block_tables_ref[b, packed_ref[row * num_slots + slot]], 0)
    return h, physical, 0, 0


def _slot_scale_index_map(*args, **kwargs):
    """`_slot_index_map` for the page's scales [Hkv, P, S] (quantized pages)."""
    return _slot_index_map(*args, **kwargs)[:3]


def _sparse_decode_kernel(
    lengths_ref,  # i32[B] (scalar prefetch)
    block_tables_ref,  # i32[B, pages_per_seq] (scalar prefetch)
    packed_ref,  # i32[B * Hkv * K] (scalar prefetch) selected logical pages, packed to the front
    counts_ref,  # i32[B * Hkv] (scalar prefetch) packed entries per (b, h)
    q_ref,  # [G, D]
    k_ref,  # [S, D]
    v_ref,  # [S, D]
    *refs,  # (quantized: k, v scale refs [S]), o_ref [G, D], scratch m, l f32[G, 1], acc f32[G, D]
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    quantized: bool = False,
):
    ks_ref, vs_ref = refs[:2] if quantized else (None, None)
    o_ref, m_ref, l_ref, acc_ref = refs[2:] if quantized else refs
    b, h, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    num_slots = pl.num_programs(2)
    row = b * pl.num_programs(1) + h
    page_size = k_ref.shape[0]
    length = lengths_ref[b]
    first_key, _, _ = visible_pages(length, page_size=page_size,
                                     pages_per_seq=block_tables_ref.shape[1],
                                     sliding_window=sliding_window)

    @pl.when(j == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(j < counts_ref[row])
    def _attend():
        q = q_ref[...].astype(jnp.float32) if quantized else q_ref[...]
        k = dequantize(k_ref[...], ks_ref[...]) if quantized else k_ref[...]
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * sm_scale  # [G, S]
        if soft_cap is not None:
            s = jnp.tanh(s / soft_cap) * soft_cap
        logical = packed_ref[row * num_slots + j]
        pos = logical * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
        visible = (pos >= first_key) & (pos < length)  # [1, S]
        s = jnp.where(visible, s, -jnp.inf)
        # NOTE: masked rows of V are zeroed, not just weighted by 0: the unused tail of a
        # partially filled page may hold anything (NaN included), and 0 * NaN = NaN.
        v = jnp.where(visible.T, dequantize(v_ref[...], vs_ref[...]) if quantized else v_ref[...], 0)

        # Packing kept only pages holding a visible key, so m_next is finite.
        m_prev = m_ref[...]  # [G, 1]
        m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next)  # [G, S]
        l_ref[...] = alpha * l_ref[...] + p.sum(axis=1, keepdims=True)
        acc_ref[...] = alpha * acc_ref[...] + lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        m_ref[...] = m_next

    @pl.when(j == num_slots - 1)
    def _finalize():
        l = l_ref[...]
        # A (b, h) that saw no key has l == 0 and acc == 0, so it returns zeros, not 0 / 0.
        o_ref[...] = (acc_ref[...] / jnp.where(l == 0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=["sm_scale", "soft_cap", "sliding_window", "interpret",
                                             "platform"])
def sparse_decode_attention(
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
    interpret: bool | pltpu.InterpretParams | None = None,
    platform: str | None = None,
    k_scales: jax.Array | None = None,  # f32[Hkv, P, S]: quantized pages
    v_scales: jax.Array | None = None,
) -> jax.Array:  # [B, Hq, D], q.dtype
    """Decode attention of one query token per sequence over the selected pages of the KV pool.

    Exactly `paged_decode_attention` (scores `(q . k) * sm_scale`, optional `tanh(s / soft_cap) *
    soft_cap`, keys at positions >= lengths[b] masked, with `sliding_window=W` the query at p sees
    p - W < k <= p, softmax in float32, query head h reads kv head h // (Hq // Hkv)) restricted to
    the keys in the logical pages `selected[b, h]` lists for that kv head. In particular, when
    `selected[b, h]` lists every used logical page of sequence b for every h, the result equals
    `paged_decode_attention` on the same inputs.

    Args:
      q: [B, Hq, D] the new token's (rotated) queries.
      k_pages, v_pages: [Hkv, P, S, D] the page pool, q's dtype; or int8 / float8_e4m3fn with
        `k_scales`, `v_scales` f32[Hkv, P, S] (a stored vector reads back as number * scale).
      block_tables: i32[B, pages_per_seq]; entry [b, i] is the physical page of sequence b's
        logical page i. Only entries of selected pages holding a visible key are read.
      lengths: i32[B], valid tokens per sequence, in [0, pages_per_seq * S].
      selected: i32[B, Hkv, K], K >= 1; the distinct logical pages each (sequence, kv head)
        attends to, by convention ascending and padded at the end with -1 (the order does not
        change the result). Entries that are negative, >= pages_per_seq, or name a page with no
        visible key (past the last used page, wholly before the window) are skipped, their
        block-table entries never used. A (b, h) with nothing left, or a sequence of length 0,
        returns zeros (no NaN). Values are traced, so not checked: a repeated page would count
        once per repeat.
      sm_scale: static score scale, e.g. head_dim ** -0.5.
      soft_cap: static logit soft cap, or None.
      sliding_window: static window W >= 1, or None for full attention.
      interpret: None picks interpret mode on CPU and compiled elsewhere; True / False force it;
        a `pltpu.InterpretParams` runs TPU interpret mode (e.g. to raise on out-of-bounds reads).
      platform: which kernel runs: "tpu" (scalar prefetch), "gpu" (Triton,
        `sparse_decode_gpu`; it lowers for CUDA from any host and runs anywhere with interpret
        mode), or None: the running backend's (gpu -> "gpu", tpu -> "tpu", cpu -> the TPU kernel
        in interpret mode).

    Raises:
      ValueError: inconsistent ranks, shapes or dtypes, or an invalid knob.
      NotImplementedError: the TPU kernel compiled on a backend other than TPU (scalar
        prefetch is TPU-only).
    """
    if kernel_platform(platform) == "gpu":
        if isinstance(interpret, pltpu.InterpretParams):
            raise ValueError(f"{interpret=} is TPU interpret mode; the GPU kernel takes a bool.")
        return sparse_decode_attention_gpu(
            q, k_pages, v_pages, block_tables, lengths, selected, sm_scale=sm_scale,
            soft_cap=soft_cap, sliding_window=sliding_window, interpret=interpret,
            k_scales=k_scales, v_scales=v_scales)
    quantized = k_scales is not None or v_scales is not None
    check_sparse_inputs(q, k_pages, v_pages, block_tables, lengths, selected, sm_scale=sm_scale,
                         soft_cap=soft_cap, sliding_window=sliding_window,
                         scales=(k_scales, v_scales) if quantized else None)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    num_slots = selected.shape[2]
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if not interpret and jax.default_backend() != "tpu":
        raise NotImplementedError(
            f"sparse_decode_attention's TPU kernel compiles only on TPU (scalar prefetch); the "
            f"backend is {jax.default_backend()!r}. Pass interpret=True, platform='gpu' for the "
            f"GPU kernel, or use sparse_decode_attention_reference.")

    # Pack each (b, h)'s usable entries to the front, so that slot j < count always names a
    # visible page and the index map can re-point trailing slots at the last one.
    packed, counts = pack_selection(selected, lengths, page_size=page_size,
                                    pages_per_seq=pages_per_seq, sliding_window=sliding_window)
    # NOTE: flat 1-D arrays, because TPU SMEM pads 2-D and 3-D arrays to whole tiles.
    packed, counts = packed.reshape(-1), counts.reshape(-1)

    group = num_q_heads // num_kv_heads
    q_grouped = q.reshape(batch, num_kv_heads, group, head_dim)
    qo_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, j, *_: (b, h, 0, 0))
    page_spec = pl.BlockSpec(
        (None, None, page_size, head_dim),
        functools.partial(_slot_index_map, num_kv_heads=num_kv_heads, num_slots=num_slots))
    scale_spec = pl.BlockSpec(
        (None, None, page_size),
        functools.partial(_slot_scale_index_map, num_kv_heads=num_kv_heads, num_slots=num_slots))
    kernel = functools.partial(_sparse_decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, quantized=quantized)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4,
            grid=(batch, num_kv_heads, num_slots),
            in_specs=[qo_spec, page_spec, page_spec, *([scale_spec] * (2 if quantized else 0))],
            out_specs=qo_spec,
            scratch_shapes=[
                pltpu.VMEM((group, 1), jnp.float32),  # running max
                pltpu.VMEM((group, 1), jnp.float32),  # running sum
                pltpu.VMEM((group, head_dim), jnp.float32),  # accumulator
            ],
        ),
        out_shape=jax.ShapeDtypeStruct(q_grouped.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name=f"sparse_decode_{page_size=}",
    )(lengths, block_tables, packed, counts, q_grouped, k_pages, v_pages,
      *((k_scales, v_scales) if quantized else ()))
    return out.reshape(batch, num_q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=["sm_scale", "soft_cap", "sliding_window"])
def sparse_decode_attention_reference(
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
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:  # [B, Hq, D], q.dtype
    """Plain-jnp `sparse_decode_attention`: gather each (b, h)'s selected pages, mask, softmax in
    f32. Same semantics and errors (ValueError); a (b, h) with nothing visible returns zeros.
    """
    quantized = k_scales is not None or v_scales is not None
    check_sparse_inputs(q, k_pages, v_pages, block_tables, lengths, selected, sm_scale=sm_scale,
                         soft_cap=soft_cap, sliding_window=sliding_window,
                         scales=(k_scales, v_scales) if quantized else None)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_keys = selected.shape[2] * page_size

    usable = visible_selection(selected, lengths, page_size=page_size,
                                pages_per_seq=block_tables.shape[1],
                                sliding_window=sliding_window)  # [B, Hkv, K]
    logical = jnp.where(usable, selected, 0)
    physical = jnp.where(usable, block_tables[jnp.arange(batch)[:, None, None], logical], 0)

    def gather(pages, scales):  # [Hkv, P, S, D] -> [B, Hkv, T, D] in float32
        at = (jnp.arange(num_kv_heads)[None, :, None], physical)
        g = dequantize(pages[at], None if scales is None else scales[at])  # [B, Hkv, K, S, D]
        return g.reshape(batch, num_kv_heads, num_keys, head_dim)

    k, v = gather(k_pages, k_scales), gather(v_pages, v_scales)
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    exact = jax.lax.Precision.HIGHEST  # TPU would otherwise run f32 matmuls in one bf16 pass
    scores = jnp.einsum("bhgd,bhtd->bhgt", qg, k, precision=exact) * sm_scale
    if soft_cap is not None:
        scores = jnp.tanh(scores / soft_cap) * soft_cap
    first_key, _, _ = visible_pages(lengths, page_size=page_size,
                                     pages_per_seq=block_tables.shape[1],
                                     sliding_window=sliding_window)
    pos = logical[..., None] * page_size + jnp.arange(page_size)  # [B, Hkv, K, S]
    visible = (usable[..., None] & (pos >= jnp.reshape(first_key, (-1, 1, 1, 1)))
               & (pos < lengths[:, None, None, None]))
    visible = visible.reshape(batch, num_kv_heads, 1, num_keys)  # [B, Hkv, 1, T]
    scores = jnp.where(visible, scores, -jnp.inf)
    m = scores.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # nothing visible: every score is -inf
    p = jnp.where(visible, jnp.exp(scores - m), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    v = jnp.where(visible.transpose(0, 1, 3, 2), v, 0.0)  # unused slots may hold NaN
    out = jnp.einsum("bhgt,bhtd->bhgd", p, v, precision=exact) / jnp.where(denom == 0, 1.0, denom)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
