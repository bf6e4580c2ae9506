"""Paged decode attention for NVIDIA GPUs: the Pallas Triton backend.

Same inputs and semantics as `paged_decode.paged_decode_attention` (and its reference); only the
way the kernel walks the pool differs, because Triton has no scalar prefetch:

- grid `(batch, kv_head, split)`. A program owns one kv head of one sequence, all
  `G = num_q_heads // num_kv_heads` query heads of its group at once (padded with zero rows to
  `block_g`, at least 16: the MMA minimum), and one of `k_splits` contiguous ranges of logical
  pages (split-K: a long sequence still fills the GPU at batch 1).
- the kv head's whole page pool `[num_pages, page_size, head_dim]` and the block tables are
  ordinary inputs (pointers). Each loop step reads `pages_per_step` block-table entries and
  gathers those pages with one vector load of their rows.
- the loop runs over the split's pages that hold a visible key only: its bounds come from the
  sequence's length (and window), so no page past the last used one, nor before the window, is
  touched. Loads are masked per key: the tail of a partial last page (and the keys before the
  window in the first page) is never read; nor is a block-table entry past the used pages.
- online softmax in float32 per split; each split writes its unnormalised accumulator, running
  max and running sum, and `merge_splits` (plain jnp, outside the kernel) combines them by
  log-sum-exp. Scores and accumulation are float32 for f16 / bf16 / f32 inputs.

Quantized pages (int8 / float8_e4m3fn with `k_scales`, `v_scales` f32[Hkv, P, S]): each step
also gathers its keys' scales (masked alike) and reads keys and values back as number * scale in
float32, so scores and accumulation are float32 as for float pools.

Compiled on a CUDA backend; `interpret=True` (the default off GPU) runs the same kernel on any
backend, and `jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))` compiles it to a
Triton custom call from a CPU host. Triton tensors have power-of-two shapes: the group, the page
size and the head dimension are padded up to one inside the kernel (masked loads), so any
shape runs; powers of two waste nothing.
"""

from __future__ import annotations

import functools
import numbers

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.decode_common import check_inputs, visible_pages

MIN_DOT_DIM = 16  # Triton's tl.dot needs every dimension >= 16
TARGET_PROGRAMS = 256  # enough programs for ~2 waves over 132 SMs (H100 / H200); a heuristic


def next_pow2(n: int, minimum: int = 1) -> int:
    return max(minimum, 1 << max(int(n) - 1, 0).bit_length())


def default_pages_per_step(page_size: int) -> int:
    """Pages gathered per loop step: ~128 keys, the tile a decode step's MMA likes."""
    return next_pow2(max(1, 128 // next_pow2(page_size)))


def default_k_splits(batch: int, num_kv_heads: int, num_steps: int) -> int:
    """Splits so that batch x kv heads x splits reaches `TARGET_PROGRAMS`, but no split is empty
    of loop steps."""
    return max(1, min(num_steps, pl.cdiv(TARGET_PROGRAMS, batch * num_kv_heads)))


def attend_pages_step(carry, q, pools, physical, logical, page_ok, *, length, first_key,
                      sm_scale, soft_cap):
    """One online-softmax step of a program over `n` gathered pages.

    carry: (m f32[Gp], l f32[Gp], acc f32[Gp, Dp]); q: [Gp, Dp] (zero padded);
    pools: (k_ref, v_ref) [num_pages, S, D] one kv head's pool, + (k_scale_ref, v_scale_ref)
    [num_pages, S] when quantized; physical, logical: i32[n] page ids;
    page_ok: bool[n], False for the step's pages past its range (their ids are never used).
    The first of the n pages must hold a visible key (so the running max stays finite).
    """
    k_ref, v_ref = pools[:2]
    m_prev, l_prev, acc_prev = carry
    n = physical.shape[0]
    _, page_size, head_dim = k_ref.shape
    block_s, block_d = next_pow2(page_size), q.shape[1]
    slot = lax.broadcasted_iota(jnp.int32, (n, block_s), 1)  # [n, Sp]
    pos = logical[:, None] * page_size + slot
    visible = page_ok[:, None] & (pos >= first_key) & (pos < length)
    if block_s > page_size:  # padding slots of a page size that is not a power of two
        visible &= slot < page_size
    d = lax.broadcasted_iota(jnp.int32, (1, 1, block_d), 2)
    # NOTE: masked keys load as 0, never read: the tail of a partial page may hold anything
    # (NaN included), and masking the scores alone would give 0 * NaN = NaN in p @ v.
    rows = (jnp.where(page_ok, physical, 0)[:, None, None], slot[:, :, None], d)
    # A mask constant along head_dim (the usual power-of-two case) lets Triton vectorise loads.
    mask = visible[:, :, None] if block_d == head_dim else visible[:, :, None] & (d < head_dim)
    k = plgpu.load(k_ref.at[rows], mask=mask, other=0).reshape(n * block_s, block_d)
    v = plgpu.load(v_ref.at[rows], mask=mask, other=0).reshape(n * block_s, block_d)
    if len(pools) == 4:  # quantized: each key's and value's scale, masked like the key (a NaN scale
        # of an invisible slot is never loaded)
        at = (rows[0][:, :, 0], slot)
        ks = plgpu.load(pools[2].at[at], mask=visible, other=0).reshape(n * block_s, 1)
        vs = plgpu.load(pools[3].at[at], mask=visible, other=0).reshape(n * block_s, 1)
        k, v, q = k.astype(jnp.float32) * ks, v.astype(jnp.float32) * vs, q.astype(jnp.float32)
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # f32: no TF32
    s = plgpu.dot(q, k, trans_b=True, precision=precision) * sm_scale  # f32[Gp, n * Sp]
    if soft_cap is not None:
        s = jnp.tanh(s / soft_cap) * soft_cap
    s = jnp.where(visible.reshape(1, n * block_s), s, -jnp.inf)
    m_next = jnp.maximum(m_prev, s.max(axis=1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, None])
    l_next = alpha * l_prev + p.sum(axis=1)
    acc_next = alpha[:, None] * acc_prev + plgpu.dot(p.astype(v.dtype), v, precision=precision)
    return m_next, l_next, acc_next


def init_carry(block_g: int, block_d: int):
    return (jnp.full((block_g,), -jnp.inf, jnp.float32), jnp.zeros((block_g,), jnp.float32),
            jnp.zeros((block_g, block_d), jnp.float32))


def merge_splits(o, m, l, *, group: int, head_dim: int, dtype):
    """Log-sum-exp merge of per-split partial results into the output.

    o: f32[K, B, Hkv, Gp, Dp] unnormalised accumulators, m / l: f32[K, B, Hkv, Gp] running max
    and sum (m = -inf, l = 0 for a split that saw no key) -> [B, Hkv * group, head_dim] dtype.
    A row no split saw (empty sequence or selection) is zeros, not 0 / 0.
    """
    m_all = m.max(axis=0)
    m_all = jnp.where(jnp.isfinite(m_all), m_all, 0.0)
    w = jnp.where(jnp.isfinite(m), jnp.exp(m - m_all), 0.0)  # [K, B, Hkv, Gp]
    l_all = (w * l).sum(axis=0)
    acc = (w[..., None] * o).sum(axis=0)
    out = acc / jnp.where(l_all == 0, 1.0, l_all)[..., None]
    batch, num_kv_heads = out.shape[:2]
    return out[:, :, :group, :head_dim].reshape(batch, num_kv_heads * group, head_dim).astype(dtype)


def split_k_call(kernel, index_inputs, q_blocks, k_pages, v_pages, *, splits, num_warps,
                 num_stages, interpret, name, scales=()):
    """Run `kernel` over grid (batch, kv_head, split) -> per-split (o, m, l) for `merge_splits`.

    `index_inputs` (lengths, tables, selections: small int32 arrays) go in whole, as pointers;
    each program gets its (b, h) query block [Gp, Dp] and its kv head's whole pool [P, S, D]
    (and, `scales` = (k_scales, v_scales) of quantized pages, its scales [P, S]).
    """
    batch, num_kv_heads, block_g, block_d = q_blocks.shape
    _, num_pages, page_size, head_dim = k_pages.shape
    pool_spec = pl.BlockSpec((None, num_pages, page_size, head_dim), lambda b, h, s: (h, 0, 0, 0))
    scale_spec = pl.BlockSpec((None, num_pages, page_size), lambda b, h, s: (h, 0, 0))
    index_specs = [pl.BlockSpec(x.shape, lambda b, h, s, nd=x.ndim: (0,) * nd)
                   for x in index_inputs]
    partial_shape = (splits, batch, num_kv_heads, block_g)
    return pl.pallas_call(
        kernel,
        grid=(batch, num_kv_heads, splits),
        in_specs=[
            *index_specs,
            pl.BlockSpec((None, None, block_g, block_d), lambda b, h, s: (b, h, 0, 0)),
            pool_spec,
            pool_spec,
            *([scale_spec] * len(scales)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, block_g, block_d), lambda b, h, s: (s, b, h, 0, 0)),
            pl.BlockSpec((None, None, None, block_g), lambda b, h, s: (s, b, h, 0)),
            pl.BlockSpec((None, None, None, block_g), lambda b, h, s: (s, b, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*partial_shape, block_d), jnp.float32),  # unnormalised acc
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),  # running max
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),  # running sum
        ],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*index_inputs, q_blocks, k_pages, v_pages, *scales)


def _paged_decode_gpu_kernel(
    lengths_ref,  # i32[B]
    tables_ref,  # i32[B, pages_per_seq]
    q_ref,  # [Gp, Dp]
    *refs,  # k_ref, v_ref [P, S, D] this kv head's pool (+ k, v scale refs [P, S] when
    #          quantized), then o_ref f32[Gp, Dp] this split's unnormalised accumulator,
    #          m_ref, l_ref f32[Gp] running max and sum
    sm_scale: float,
    soft_cap: float | None,
    sliding_window: int | None,
    pages_per_step: int,
    pages_per_split: int,
):
    pools, (o_ref, m_ref, l_ref) = refs[:-3], refs[-3:]
    k_ref = pools[0]
    b, split = pl.program_id(0), pl.program_id(2)
    n = pages_per_step
    page_size = k_ref.shape[1]
    pages_per_seq = tables_ref.shape[1]
    length = lengths_ref[b]
    first_key, first_page, last_page = visible_pages(
        length, page_size=page_size, pages_per_seq=pages_per_seq, sliding_window=sliding_window)
    # This split's pages that hold a visible key: [lo, hi). Empty for most splits of a short
    # sequence; then the loop runs zero times and the split reports m = -inf, l = 0.
    lo = jnp.maximum(split * pages_per_split, first_page)
    hi = jnp.minimum((split + 1) * pages_per_split, last_page + 1)
    q = q_ref[...]

    def body(i, carry):
        start = lo + i * n
        logical = start + lax.broadcasted_iota(jnp.int32, (n,), 0)
        page_ok = logical < hi
        physical = plgpu.load(tables_ref.at[b, pl.ds(start, n)], mask=page_ok, other=0)
        return attend_pages_step(carry, q, pools, physical, logical, page_ok,
                                 length=length, first_key=first_key, sm_scale=sm_scale,
                                 soft_cap=soft_cap)

    num_steps = pl.cdiv(jnp.maximum(hi - lo, 0), n)
    m, l, acc = lax.fori_loop(0, num_steps, body, init_carry(*q_ref.shape))
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def check_gpu_knobs(*, pages_per_step, k_splits, num_warps, num_stages):
    """The GPU kernels' tuning knobs; raises ValueError naming the knob."""
    if pages_per_step is not None and not (
            isinstance(pages_per_step, numbers.Integral) and pages_per_step >= 1
            and pages_per_step & (pages_per_step - 1) == 0):
        raise ValueError(f"{pages_per_step=} must be None or a power of two >= 1.")
    if k_splits is not None and not (isinstance(k_splits, numbers.Integral) and k_splits >= 1):
        raise ValueError(f"{k_splits=} must be None or an int >= 1.")
    for name, value in (("num_warps", num_warps), ("num_stages", num_stages)):
        if not (isinstance(value, numbers.Integral) and value >= 1):
            raise ValueError(f"{name}={value!r} must be an int >= 1.")


def pad_queries(q, num_kv_heads: int):
    """[B, Hq, D] -> [B, Hkv, Gp, Dp], zero padded to powers of two >= 16 (Triton dot shapes)."""
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // num_kv_heads
    block_g, block_d = next_pow2(group, MIN_DOT_DIM), next_pow2(head_dim, MIN_DOT_DIM)
    q = q.reshape(batch, num_kv_heads, group, head_dim)
    return jnp.pad(q, ((0, 0), (0, 0), (0, block_g - group), (0, block_d - head_dim)))


@functools.partial(
    jax.jit,
    static_argnames=["sm_scale", "soft_cap", "sliding_window", "pages_per_step", "k_splits",
                     "num_warps", "num_stages", "interpret"],
)
def paged_decode_attention_gpu(
    q: jax.Array,  # [B, Hq, D]
    k_pages: jax.Array,  # [Hkv, P, S, D]
    v_pages: jax.Array,  # [Hkv, P, S, D]
    block_tables: jax.Array,  # i32[B, pages_per_seq]
    lengths: jax.Array,  # i32[B]
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
    """`paged_decode_attention` (same semantics, arguments and ValueErrors) as a Triton kernel.

    Knobs: `pages_per_step` pages gathered per loop step (a power of two; None: ~128 keys);
    `k_splits` ranges of pages per sequence run by separate programs and merged by log-sum-exp
    (None: enough programs to fill an H100-class GPU); `num_warps`, `num_stages` go to Triton.
    `interpret`: None runs compiled on a GPU backend and in interpret mode elsewhere.
    """
    scales = () if k_scales is None and v_scales is None else (k_scales, v_scales)
    check_inputs(q, k_pages, v_pages, block_tables, lengths, sm_scale=sm_scale,
                 soft_cap=soft_cap, sliding_window=sliding_window, scales=scales or None)
    check_gpu_knobs(pages_per_step=pages_per_step, k_splits=k_splits, num_warps=num_warps,
                    num_stages=num_stages)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads, _, page_size, _ = k_pages.shape
    pages_per_seq = block_tables.shape[1]
    n = pages_per_step or default_pages_per_step(page_size)
    n = max(n, MIN_DOT_DIM // next_pow2(page_size))  # n * Sp keys >= 16 for the dot
    splits = k_splits or default_k_splits(batch, num_kv_heads, pl.cdiv(pages_per_seq, n))
    splits = min(splits, pages_per_seq)
    pages_per_split = pl.cdiv(pages_per_seq, splits)
    if interpret is None:
        interpret = jax.default_backend() not in ("gpu", "cuda", "rocm")

    q_blocks = pad_queries(q, num_kv_heads)  # [B, Hkv, Gp, Dp]
    kernel = functools.partial(
        _paged_decode_gpu_kernel, sm_scale=sm_scale, soft_cap=soft_cap,
        sliding_window=sliding_window, pages_per_step=n, pages_per_split=pages_per_split)
    o, m, l = split_k_call(kernel, [lengths, block_tables], q_blocks, k_pages, v_pages,
                           splits=splits, num_warps=num_warps, num_stages=num_stages,
                           interpret=interpret, name=f"paged_decode_gpu_{page_size=}_{n=}",
                           scales=scales)
    return merge_splits(o, m, l, group=num_q_heads // num_kv_heads, head_dim=head_dim,
                        dtype=q.dtype)
