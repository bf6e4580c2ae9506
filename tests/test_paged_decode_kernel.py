"""pallas_kernels.paged_decode: the Pallas kernel (interpret mode) against its jnp reference and
against jax's own paged-attention reference, on fresh random pools where every slot no sequence
may see is NaN (unused physical pages, the tails of partly filled last pages, and the pages that
block-table entries past a sequence's used pages point to).

Every test draws from one fixed seed and names it in its failure messages; set PAGED_DECODE_SEED to
try another. Tolerances come from the computation (`attention_tolerance`), not from a chosen number.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

from gemini_jax.testing import float_tolerance
from pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference

SEED = 20260301


@pytest.fixture
def seed() -> int:
    return int(os.environ.get("PAGED_DECODE_SEED", SEED))


class Case(NamedTuple):
    q: jax.Array  # [B, Hq, D]
    k_pages: jax.Array  # [Hkv, P, S, D]
    v_pages: jax.Array
    block_tables: jax.Array  # i32[B, pages_per_seq]
    lengths: jax.Array  # i32[B]


def varied_lengths(rng, page_size: int, pages_per_seq: int) -> list[int]:
    """Four lengths: inside the first page, page-aligned, a partial last page, anything."""
    cap = page_size * pages_per_seq
    lengths = [
        int(rng.integers(1, page_size)),
        page_size * int(rng.integers(1, pages_per_seq + 1)),
        int(rng.integers(2, pages_per_seq + 1)) * page_size - int(rng.integers(1, page_size)),
        int(rng.integers(1, cap + 1)),
    ]
    return [int(x) for x in rng.permutation(lengths)]


def make_case(rng, lengths, *, page_size, pages_per_seq, num_kv_heads, group, head_dim,
              dtype=jnp.float32, q_scale=2.0, spare_pages=3) -> Case:
    """A pool holding the given sequences on randomly permuted physical pages, NaN elsewhere."""
    used = [-(-n // page_size) for n in lengths]
    assert max(used) <= pages_per_seq
    num_pages = sum(used) + spare_pages
    shape = (num_kv_heads, num_pages, page_size, head_dim)
    k = rng.standard_normal(shape, dtype=np.float32)
    v = rng.standard_normal(shape, dtype=np.float32)
    physical = rng.permutation(num_pages)
    nan_pages = physical[sum(used):]
    k[:, nan_pages] = np.nan
    v[:, nan_pages] = np.nan
    tables = rng.choice(nan_pages, size=(len(lengths), pages_per_seq)).astype(np.int32)
    start = 0
    for b, (n, u) in enumerate(zip(lengths, used)):
        tables[b, :u] = physical[start:start + u]
        start += u
        if u:
            last = tables[b, u - 1]
            k[:, last, n - (u - 1) * page_size:] = np.nan
            v[:, last, n - (u - 1) * page_size:] = np.nan
    q = q_scale * rng.standard_normal((len(lengths), num_kv_heads * group, head_dim))
    return Case(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
                jnp.asarray(tables), jnp.asarray(lengths, jnp.int32))


def attention_tolerance(case: Case, ref, dtype="float32") -> float:
    """Kernel vs reference, two float evaluations of one attention: three steps in sequence (q.k
    over head_dim, the softmax's sum over the keys, the weighted sum of V over them), the longest
    over every key a block table can reach, at the magnitude of the reference output."""
    keys = case.block_tables.shape[1] * case.k_pages.shape[2]
    return float_tolerance(dtype=dtype, depth=3, terms=max(case.q.shape[-1], keys),
                           magnitude=float(np.abs(np.asarray(ref, np.float32)).max()))


def bf16_tolerance(ref) -> float:
    """A bfloat16 kernel vs the float32 reference on the same inputs: the kernel rounds its softmax
    weights to bfloat16 before the weighted sum (accumulated in float32), then its output."""
    return float_tolerance(dtype="bfloat16", depth=2, magnitude=float(np.abs(np.asarray(ref, np.float32)).max()))


def run_both(case: Case, *, pages_per_compute_block=1, interpret=None, **knobs):
    out = paged_decode_attention(*case, pages_per_compute_block=pages_per_compute_block,
                                 interpret=interpret, **knobs)
    ref = paged_decode_attention_reference(*case, **knobs)
    return np.asarray(out, np.float32), np.asarray(ref, np.float32)


# (page_size, pages_per_seq, num_kv_heads, group, soft_cap, sliding_window, pages_per_compute_block)
# Every page size meets every GQA ratio once; soft cap, windows (below a page, above a page, above
# every length) and compute-block widths (including one that does not divide pages_per_seq) are
# spread across them, keeping the interpret-mode compiles few.
CASES = [
    (8, 4, 2, 1, None, None, 1),
    (8, 4, 2, 2, 3.0, 3, 1),
    (8, 4, 1, 4, None, 11, 2),
    (16, 4, 2, 1, 3.0, None, 3),
    (16, 4, 1, 2, None, 5, 1),
    (16, 4, 2, 4, 3.0, 1000, 2),
    (64, 3, 1, 1, None, 70, 1),
    (64, 3, 2, 2, 3.0, None, 2),
    (64, 3, 1, 4, None, None, 1),
]


@pytest.mark.parametrize("page_size,pages_per_seq,num_kv_heads,group,soft_cap,window,ppcb", CASES)
def test_kernel_matches_reference(seed, page_size, pages_per_seq, num_kv_heads, group, soft_cap,
                                  window, ppcb):
    rng = np.random.default_rng(seed)
    lengths = varied_lengths(rng, page_size, pages_per_seq)
    case = make_case(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                     num_kv_heads=num_kv_heads, group=group, head_dim=16)
    knobs = dict(sm_scale=16 ** -0.5, soft_cap=soft_cap, sliding_window=window)
    out, ref = run_both(case, pages_per_compute_block=ppcb, **knobs)
    msg = f"seed={seed} lengths={lengths} knobs={knobs} ppcb={ppcb}"
    assert np.isfinite(ref).all(), msg
    tol = attention_tolerance(case, ref)
    np.testing.assert_allclose(out, ref, atol=tol, rtol=0, err_msg=msg)

    # The knobs must matter where they should, or the comparison above proves nothing about them.
    plain = np.asarray(paged_decode_attention_reference(*case, sm_scale=knobs["sm_scale"]))
    # (A window must hide several keys of some sequence for its effect to be reliably visible.)
    if soft_cap is not None or (window is not None and window + page_size // 2 < max(lengths)):
        moved_by = float(np.abs(ref - plain).max())
        assert moved_by > 10 * tol, f"knobs had no effect (the output moved by {moved_by:.3g}); {msg}"
    elif window is None or window >= max(lengths):
        np.testing.assert_allclose(ref, plain, atol=tol, rtol=0, err_msg=msg)


def test_bfloat16_matches_float32_reference(seed):
    rng = np.random.default_rng(seed)
    lengths = varied_lengths(rng, 16, 4)
    case = make_case(rng, lengths, page_size=16, pages_per_seq=4, num_kv_heads=2, group=2,
                     head_dim=16, dtype=jnp.bfloat16)
    knobs = dict(sm_scale=0.25, soft_cap=3.0, sliding_window=20)
    out = paged_decode_attention(*case, pages_per_compute_block=2, **knobs)
    assert out.dtype == jnp.bfloat16
    # The reference upcasts the same bf16 inputs and stays in float32 throughout.
    ref = paged_decode_attention_reference(
        *(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in case), **knobs)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=bf16_tolerance(ref), rtol=0,
                               err_msg=f"seed={seed} lengths={lengths}")


def test_empty_sequence_returns_zeros(seed):
    rng = np.random.default_rng(seed)
    lengths = [0, int(rng.integers(1, 17)), 0, int(rng.integers(17, 33))]
    case = make_case(rng, lengths, page_size=8, pages_per_seq=4, num_kv_heads=2, group=2,
                     head_dim=8)
    out, ref = run_both(case, sm_scale=0.3, sliding_window=6)
    msg = f"seed={seed} lengths={lengths}"
    assert np.isfinite(out).all(), msg
    np.testing.assert_array_equal(out[[0, 2]], 0.0, err_msg=msg)
    np.testing.assert_allclose(out, ref, atol=attention_tolerance(case, ref), rtol=0, err_msg=msg)


def _out_of_range_outside_window(case: Case, window: int | None, page_size: int) -> Case:
    """Point every block-table entry the kernel must not use (past the used pages, or wholly
    before the sliding window) far outside the pool."""
    tables = np.array(case.block_tables)
    num_pages = case.k_pages.shape[1]
    for b, n in enumerate(np.asarray(case.lengths)):
        first = 0 if window is None else max(int(n) - window, 0) // page_size
        used = -(-int(n) // page_size)
        tables[b, :first] = num_pages + 1000 + b
        tables[b, used:] = num_pages + 2000 + b
    return case._replace(block_tables=jnp.asarray(tables))


@pytest.mark.parametrize("window,ppcb", [(None, 3), (9, 1)])
def test_never_reads_pages_outside_visible_span(seed, window, ppcb):
    """TPU interpret mode raises on any out-of-bounds read, so out-of-range block-table entries
    outside a sequence's visible span prove those entries (and their pages) are never read."""
    rng = np.random.default_rng(seed)
    lengths = varied_lengths(rng, 8, 4)
    case = make_case(rng, lengths, page_size=8, pages_per_seq=4, num_kv_heads=1, group=2,
                     head_dim=8)
    case = _out_of_range_outside_window(case, window, page_size=8)
    strict = pltpu.InterpretParams(out_of_bounds_reads="raise")
    try:
        out, ref = run_both(case, pages_per_compute_block=ppcb, interpret=strict, sm_scale=0.3,
                            sliding_window=window)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    np.testing.assert_allclose(out, ref, atol=attention_tolerance(case, ref), rtol=0,
                               err_msg=f"seed={seed} lengths={lengths} tables={case.block_tables}")


def test_out_of_bounds_detection_fires_on_a_used_page(seed):
    """Control for the test above: a bad entry inside the visible span must be caught."""
    rng = np.random.default_rng(seed)
    lengths = [int(rng.integers(9, 33)) for _ in range(3)]
    case = make_case(rng, lengths, page_size=8, pages_per_seq=4, num_kv_heads=1, group=2,
                     head_dim=8)
    tables = np.array(case.block_tables)
    tables[1, 1] = case.k_pages.shape[1] + 7  # sequence 1 uses logical page 1 (length > 8)
    case = case._replace(block_tables=jnp.asarray(tables))
    strict = pltpu.InterpretParams(out_of_bounds_reads="raise")
    try:
        with pytest.raises(Exception, match="Out-of-bounds"):
            jax.block_until_ready(paged_decode_attention(*case, sm_scale=0.3, interpret=strict))
    finally:
        pltpu.reset_tpu_interpret_mode_state()


@pytest.mark.parametrize("soft_cap", [None, 3.0])
def test_matches_jax_paged_attention_reference(seed, soft_cap):
    """jax's reference takes contiguous K/V [B, T, Hkv, D], no sm_scale (we fold it into q: jax
    caps q.k, we cap (q.k) * sm_scale) and no window. Its mask is a finite value times zero
    weight, so slots past each length must be finite there: fill them with fresh noise."""
    rng = np.random.default_rng(seed)
    page_size, pages_per_seq, sm_scale = 8, 4, 0.35
    lengths = varied_lengths(rng, page_size, pages_per_seq)
    case = make_case(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                     num_kv_heads=2, group=2, head_dim=16)
    out = paged_decode_attention(*case, sm_scale=sm_scale, soft_cap=soft_cap)

    num_keys = page_size * pages_per_seq

    def dense(pages):  # [Hkv, P, S, D] -> [B, T, Hkv, D], noise past each length
        g = np.asarray(pages)[:, np.asarray(case.block_tables)]  # [Hkv, B, W, S, D]
        g = g.reshape(g.shape[0], g.shape[1], num_keys, -1).transpose(1, 2, 0, 3).copy()
        for b, n in enumerate(lengths):
            g[b, n:] = rng.standard_normal(g[b, n:].shape)
        return jnp.asarray(g)

    ref = jax_paged.paged_attention_reference(case.q * sm_scale, dense(case.k_pages),
                                              dense(case.v_pages), case.lengths,
                                              attn_logits_soft_cap=soft_cap)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=attention_tolerance(case, ref), rtol=0,
                               err_msg=f"seed={seed} lengths={lengths} soft_cap={soft_cap}")


def _valid_inputs():
    rng = np.random.default_rng(0)  # shapes only matter here; the values are never computed on
    return dict(
        q=jnp.asarray(rng.standard_normal((2, 4, 8)), jnp.float32),
        k_pages=jnp.asarray(rng.standard_normal((2, 5, 8, 8)), jnp.float32),
        v_pages=jnp.asarray(rng.standard_normal((2, 5, 8, 8)), jnp.float32),
        block_tables=jnp.asarray([[0, 1], [2, 3]], jnp.int32),
        lengths=jnp.asarray([5, 16], jnp.int32),
    )


BAD_INPUTS = [
    ("q rank", dict(q=np.ones((2, 4), np.float32)), {}, r"q\.shape="),
    ("GQA ratio", dict(q=np.ones((2, 3, 8), np.float32)), {}, r"num_q_heads=3 must"),
    ("k/v mismatch", dict(v_pages=np.ones((2, 5, 4, 8), np.float32)), {}, r"v_pages\.shape="),
    ("head_dim", dict(q=np.ones((2, 4, 16), np.float32)), {}, r"head_dim must equal"),
    ("kv dtype", dict(k_pages=np.ones((2, 5, 8, 8), jnp.bfloat16)), {}, r"k_pages\.dtype="),
    ("lengths dtype", dict(lengths=np.asarray([5.0, 16.0], np.float32)), {}, r"lengths\.dtype="),
    ("table batch", dict(block_tables=np.zeros((3, 2), np.int32)), {}, r"block_tables\.shape="),
    ("sm_scale", {}, dict(sm_scale=0.0), r"sm_scale=0\.0"),
    ("soft_cap", {}, dict(soft_cap=-1.0), r"soft_cap=-1\.0"),
    ("window", {}, dict(sliding_window=0), r"sliding_window=0"),
]


@pytest.mark.parametrize("fn", [paged_decode_attention, paged_decode_attention_reference],
                         ids=["kernel", "reference"])
@pytest.mark.parametrize("_name,arrays,knobs,match", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_validation_errors(fn, _name, arrays, knobs, match):
    inputs = {**_valid_inputs(), **arrays}
    with pytest.raises(ValueError, match=match):
        fn(**inputs, **{"sm_scale": 0.3, **knobs})


@pytest.mark.parametrize("ppcb", [0, 3])
def test_compute_block_must_fit_block_table(ppcb):
    with pytest.raises(ValueError, match=rf"pages_per_compute_block={ppcb} must be"):
        paged_decode_attention(**_valid_inputs(), sm_scale=0.3, pages_per_compute_block=ppcb)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU refusal")
def test_compiled_mode_refused_off_tpu():
    with pytest.raises(NotImplementedError, match="interpret=True"):
        paged_decode_attention(**_valid_inputs(), sm_scale=0.3, interpret=False)


@pytest.mark.slow
def test_kernel_matches_reference_larger(seed):
    rng = np.random.default_rng(seed)
    page_size, pages_per_seq = 16, 16
    lengths = varied_lengths(rng, page_size, pages_per_seq) + [
        int(rng.integers(1, page_size * pages_per_seq + 1)) for _ in range(2)]
    case = make_case(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                     num_kv_heads=4, group=4, head_dim=64)
    knobs = dict(sm_scale=64 ** -0.5, soft_cap=20.0, sliding_window=100)
    out, ref = run_both(case, pages_per_compute_block=4, **knobs)
    np.testing.assert_allclose(out, ref, atol=attention_tolerance(case, ref), rtol=0,
                               err_msg=f"seed={seed} lengths={lengths}")
