"""Paged decode attention: one new query token per sequence against its pages of a KV pool.

Layout is jax's Pallas one: pages `[kv_heads, num_pages, page_size, head_dim]`, a block table
`i32[batch, pages_per_seq]` mapping each sequence's logical pages to physical ones, and
`lengths i32[batch]` counting valid tokens (the current token included; its K/V is already in the
pages, and the query sits at position `lengths[b] - 1`).

How the kernel walks the pool:

- grid `(batch, kv_head, page_block)`; one step sees `pages_per_compute_block` pages of one
  sequence for one kv head, and all `G = num_q_heads // num_kv_heads` query heads of that group.
- `lengths` and `block_tables` are scalar-prefetched (`pltpu.PrefetchScalarGridSpec`), so the K/V
  index maps read the block table and fetch exactly the physical page a step needs. Steps past the
  sequence's last page (or before its sliding window) re-point at the nearest visible page: on TPU
  an unchanged block index issues no new copy, and the step's compute is skipped with `pl.when`.
  So pages outside `[first visible page, last used page]` are never read, and block-table entries
  past a sequence's used pages are never even looked up: they may hold anything.
- online softmax in float32 (running max, running sum, accumulator in scratch), written out at
  the last page block.

Quantized pages (int8 / float8_e4m3fn) come with `k_scales`, `v_scales` [Hkv, P, S] float32,
one per stored vector: each step fetches a page's scales beside it (the same index map) and
reads keys and values back as number * scale in float32, in the kernel.

Backends: interpret mode (the default on CPU) runs everywhere; tests run it, and TPU interpret
mode (`interpret=pltpu.InterpretParams(...)`) checks that no out-of-bounds page is read.
Compiled, scalar prefetch exists only on TPU (that path has not been run on a TPU yet). GPU
(Triton) has no scalar prefetch: `platform="gpu"` (the default on a GPU backend) runs the
variant in `paged_decode_gpu` instead, with the same semantics.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.decode_common import check_inputs, dequantize, kernel_platform, visible_pages
from pallas_kernels.paged_decode_gpu import paged_decode_attention_gpu


def _page_index_map(b, h, i, lengths_ref, block_tables_ref, *, offset, page_size,
                    pages_per_compute_block, sliding_window):
    """Block index of the `offset`-th page of step (b, h, i): the physical page of that logical
    page, clamped into the visible span so that no step touches a page outside it."""
    pages_per_seq = block_tables_ref.shape[1]
    _, first_page, last_page = visible_pages(
        lengths_ref[b], page_size=page_size, pages_per_seq=pages_per_seq,
        sliding_window=sliding_window)
    logical = jnp.clip(i * pages_per_compute_block + offset, first_page, jnp.maximum(last_page, 0))
    # NOTE: an empty sequence has no page of its own; it points at physical page 0, which
    # always exists, and its compute is skipped.
    physical = jnp.where(last_page >= 0, block_tables_ref[b, logical], 0)
    return h, physical, 0, 0


def _scale_index_map(*args, **kwargs):
    """`_page_index_map` for the page's scales [Hkv, P, S] (one axis fewer)."""
    return _page_index_map(*args, **kwargs)[:3]


def _paged_decode_kernel(
    lengths_ref,  # i32[B] (scalar prefetch)
    block_tables_ref,  # i32[B, pages_per_seq] (scalar prefetch)
    q_ref,  # [G, D]
    *refs,  # k page refs [S, D] x n, v page refs [S, D] x n, (quantized: k, v scale refs [S] x n
    #          each), o_ref [G, D], scratch m, l, acc
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_compute_block: int,
    quantized: bool = False,
):
    n = pages_per_compute_block
    k_refs, v_refs = refs[:n], refs[n:2 * n]
    ks_refs, vs_refs = (refs[2 * n:3 * n], refs[3 * n:4 * n]) if quantized else ([None] * n, [None] * n)
    o_ref, m_ref, l_ref, acc_ref = refs[4 * n:] if quantized else refs[2 * n:]
    b, i = pl.program_id(0), pl.program_id(2)
    page_size = k_refs[0].shape[0]
    length = lengths_ref[b]
    first_key, first_page, last_page = visible_pages(
        length, page_size=page_size, pages_per_seq=block_tables_ref.shape[1],
        sliding_window=sliding_window)

    @pl.when(i == 0)
    def _init():
        m_ref[...] = jnp.full_like(m_ref, -jnp.inf)
        l_ref[...] = jnp.zeros_like(l_ref)
        acc_ref[...] = jnp.zeros_like(acc_ref)

    block_start = i * n

    @pl.when((block_start <= last_page) & (block_start + n - 1 >= first_page))
    def _attend():
        q = q_ref[...].astype(jnp.float32) if quantized else q_ref[...]
        scores, values = [], []
        for t in range(n):
            k = dequantize(k_refs[t][...], ks_refs[t][...]) if quantized else k_refs[t][...]
            s = lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                                preferred_element_type=jnp.float32) * sm_scale  # [G, S]
            if soft_cap is not None:
                s = jnp.tanh(s / soft_cap) * soft_cap
            # Positions come from the logical page, not the (clamped) fetched one, so a
            # re-pointed duplicate page is masked out entirely.
            pos = (block_start + t) * page_size + lax.broadcasted_iota(jnp.int32, (1, page_size), 1)
            visible = (pos >= first_key) & (pos < length)  # [1, S]
            scores.append(jnp.where(visible, s, -jnp.inf))
            # NOTE: masked rows of V are zeroed, not just weighted by 0: the unused tail of a
            # partially filled page may hold anything (NaN included), and 0 * NaN = NaN.
            v = dequantize(v_refs[t][...], vs_refs[t][...]) if quantized else v_refs[t][...]
            values.append(jnp.where(visible.T, v, 0))

        # Every block that reaches here holds at least one visible key, so m_next is finite.
        m_prev = m_ref[...]  # [G, 1]
        m_next = functools.reduce(jnp.maximum, [s.max(axis=1, keepdims=True) for s in scores],
                                  m_prev)
        alpha = jnp.exp(m_prev - m_next)
        l_next = alpha * l_ref[...]
        acc_next = alpha * acc_ref[...]
        for s, v in zip(scores, values):
            p = jnp.exp(s - m_next)  # [G, S]
            l_next += p.sum(axis=1, keepdims=True)
            acc_next += lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                                        preferred_element_type=jnp.float32)
        m_ref[...], l_ref[...], acc_ref[...] = m_next, l_next, acc_next

    @pl.when(i == pl.num_programs(2) - 1)
    def _finalize():
        l = l_ref[...]
        # An empty sequence saw no key: l == 0 and acc == 0, so it returns zeros, not 0 / 0.
        o_ref[...] = (acc_ref[...] / jnp.where(l == 0, 1.0, l)).astype(o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=["sm_scale", "soft_cap", "sliding_window", "pages_per_compute_block",
                     "interpret", "platform"],
)
def paged_decode_attention(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    pages_per_compute_block: int | None = None,
    interpret: bool | pltpu.InterpretParams | None = None,
    platform: str | None = None,
    k_scales: jax.Array | None = None,  # f32[Hkv, P, S]: quantized pages
    v_scales: jax.Array | None = None,
) -> jax.Array:  # [B, Hq, D], q.dtype
    """Decode attention of one query token per sequence over its pages of the KV pool.

    scores = (q . k) * sm_scale, then `tanh(scores / soft_cap) * soft_cap` if `soft_cap`; keys at
    positions >= lengths[b] are masked, and with `sliding_window=W` so are keys at positions
    <= lengths[b] - 1 - W (the query at p sees p - W < k <= p). Softmax in float32. Query head h
    reads kv head h // (Hq // Hkv).

    Args:
      q: [B, Hq, D] the new token's (rotated) queries.
      k_pages, v_pages: [Hkv, P, S, D] the page pool, q's dtype; or int8 / float8_e4m3fn with
        `k_scales`, `v_scales` f32[Hkv, P, S] (a stored vector reads back as number * scale).
      block_tables: i32[B, pages_per_seq]; entry [b, i] is the physical page of sequence b's
        logical page i. Entries past a sequence's used pages are never read.
      lengths: i32[B], valid tokens per sequence, in [0, pages_per_seq * S]. A sequence of
        length 0 returns zeros (no NaN).
      sm_scale: static score scale, e.g. head_dim ** -0.5.
      soft_cap: static logit soft cap, or None.
      sliding_window: static window W >= 1, or None for full attention.
      pages_per_compute_block: TPU: pages handled per grid step (fewer, fatter steps), in
        [1, pages_per_seq], None: 1. GPU: pages gathered per loop step, a power of two, None:
        ~128 keys (`paged_decode_gpu` has the GPU kernel's other knobs).
      interpret: None picks interpret mode on CPU and compiled elsewhere; True / False force it;
        a `pltpu.InterpretParams` runs TPU interpret mode (e.g. to raise on out-of-bounds reads).
      platform: which kernel runs: "tpu" (scalar prefetch), "gpu" (Triton,
        `paged_decode_gpu`; it lowers for CUDA from any host and runs anywhere with interpret
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
        return paged_decode_attention_gpu(
            q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale, soft_cap=soft_cap,
            sliding_window=sliding_window, pages_per_step=pages_per_compute_block,
            interpret=interpret, k_scales=k_scales, v_scales=v_scales)
    quantized = k_scales is not None or v_scales is not None
    check_inputs(q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale,
                 soft_cap=soft_cap, sliding_window=sliding_window,
                 scales=(k_scales, v_scales) if quantized else None)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    n = 1 if pages_per_compute_block is None else pages_per_compute_block
    if not (isinstance(n, numbers.Integral) and 1 <= n <= pages_per_seq):
        raise ValueError(f"{pages_per_compute_block=} must be an int in [1, {pages_per_seq=}].")
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    if not interpret and jax.default_backend() != "tpu":
        raise NotImplementedError(
            f"paged_decode_attention's TPU kernel compiles only on TPU (scalar prefetch); the "
            f"backend is {jax.default_backend()!r}. Pass interpret=True, platform='gpu' for the "
            f"GPU kernel, or use paged_decode_attention_reference.")

    group = num_q_heads // num_kv_heads
    q_grouped = q.reshape(batch, num_kv_heads, group, head_dim)
    qo_spec = pl.BlockSpec((None, None, group, head_dim), lambda b, h, i, *_: (b, h, 0, 0))
    page_specs = [
        pl.BlockSpec((None, None, page_size, head_dim),
                     functools.partial(_page_index_map, offset=t, page_size=page_size,
                                       pages_per_compute_block=n, sliding_window=sliding_window))
        for t in range(n)
    ]
    scale_specs = [
        pl.BlockSpec((None, None, page_size),
                     functools.partial(_scale_index_map, offset=t, page_size=page_size,
                                       pages_per_compute_block=n, sliding_window=sliding_window))
        for t in range(n)
    ] if quantized else []
    kernel = functools.partial(_paged_decode_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
                               sliding_window=sliding_window, pages_per_compute_block=n,
                               quantized=quantized)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(batch, num_kv_heads, pl.cdiv(pages_per_seq, n)),
            in_specs=[qo_spec, *page_specs, *page_specs, *scale_specs, *scale_specs],
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
        name=f"paged_decode_{page_size=}_{n=}",
    )(lengths, block_tables, q_grouped, *([k_pages] * n), *([v_pages] * n),
      *(([k_scales] * n + [v_scales] * n) if quantized else []))
    return out.reshape(batch, num_q_heads, head_dim)


@functools.partial(jax.jit, static_argnames=["sm_scale", "soft_cap", "sliding_window"])
def paged_decode_attention_reference(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
    *,
    sm_scale: float,
    soft_cap: float | None = None,
    sliding_window: int | None = None,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
) -> jax.Array:  # [B, Hq, D], q.dtype
    """Plain-jnp `paged_decode_attention`: gather every block-table page, mask, softmax in f32.

    Same semantics and errors (ValueError); a sequence of length 0 returns zeros.
    """
    quantized = k_scales is not None or v_scales is not None
    check_inputs(q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale,
                 soft_cap=soft_cap, sliding_window=sliding_window,
                 scales=(k_scales, v_scales) if quantized else None)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    num_keys = block_tables.shape[1] * page_size

    def gather(pages, scales):  # [Hkv, P, S, D] -> [B, Hkv, T, D] in float32
        g = dequantize(pages[:, block_tables], None if scales is None else scales[:, block_tables])
        return g.reshape(num_kv_heads, batch, num_keys, head_dim).transpose(1, 0, 2, 3)

    k, v = gather(k_pages, k_scales), gather(v_pages, v_scales)
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    exact = jax.lax.Precision.HIGHEST  # TPU would otherwise run f32 matmuls in one bf16 pass
    scores = jnp.einsum("bhgd,bhtd->bhgt", qg, k, precision=exact) * sm_scale
    if soft_cap is not None:
        scores = jnp.tanh(scores / soft_cap) * soft_cap
    pos = jnp.arange(num_keys)[None, :]
    visible = pos < lengths[:, None]  # [B, T]
    if sliding_window is not None:
        visible &= pos >= lengths[:, None] - sliding_window
    visible = visible[:, None, None, :]  # [B, 1, 1, T]
    scores = jnp.where(visible, scores, -jnp.inf)
    m = scores.max(axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # empty sequences: every score is -inf
    p = jnp.where(visible, jnp.exp(scores - m), 0.0)
    denom = p.sum(axis=-1, keepdims=True)
    v = jnp.where(visible.transpose(0, 1, 3, 2), v, 0.0)  # unused slots may hold NaN
    out = jnp.einsum("bhgt,bhtd->bhgd", p, v, precision=exact) / jnp.where(denom == 0, 1.0, denom)
    return out.reshape(batch, num_q_heads, head_dim).astype(q.dtype)
