"""pallas_kernels.sparse_decode: the Pallas kernel (interpret mode) against its jnp reference, both
against a loop-by-loop float64 statement of the semantics, and against the dense paged kernel and
reference when every used page is selected.

Pools come from the dense kernel's tests (`make_case`: random physical pages, NaN in unused pages
and in the tails of partly filled last pages); on top, every K/V slot the query may not see through
its kv head's selection is NaN (unselected pages, keys before the sliding window).

Every test draws from the dense kernel tests' fixed seed and names it in its failure messages; set
PAGED_DECODE_SEED to try another.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from pallas_kernels.sparse_decode import (sparse_decode_attention,
                                          sparse_decode_attention_reference)
from test_paged_decode_kernel import (Case, _valid_inputs, attention_tolerance, bf16_tolerance, make_case,
                                      varied_lengths)
from test_paged_decode_kernel import seed  # noqa: F401  (the pytest fixture, used by name)


def used_pages(length: int, page_size: int) -> int:
    return -(-int(length) // page_size)


def random_selection(rng, lengths, *, page_size, pages_per_seq, num_kv_heads) -> np.ndarray:
    """i32[B, Hkv, K]: for each (b, h) a random subset of random size of the logical pages (pages
    past the used ones included), ascending, padded with -1. (0, 0) selects nothing and
    (1, Hkv - 1) exactly the used pages."""
    rows = [[np.sort(rng.choice(pages_per_seq, size=int(rng.integers(0, pages_per_seq + 1)),
                                replace=False)) for _ in range(num_kv_heads)] for _ in lengths]
    rows[0][0] = np.zeros(0, np.int64)
    rows[1][-1] = np.arange(used_pages(lengths[1], page_size))
    num_slots = max(1, max(len(r) for row in rows for r in row))
    selected = np.full((len(lengths), num_kv_heads, num_slots), -1, np.int32)
    for b, row in enumerate(rows):
        for h, pages in enumerate(row):
            selected[b, h, :len(pages)] = pages
    return selected


def first_visible_key(length: int, window: int | None) -> int:
    return 0 if window is None else max(int(length) - window, 0)


def poison_invisible(case: Case, selected: np.ndarray, *, window: int | None) -> Case:
    """NaN into every K/V slot of a used page that the query cannot see through its kv head's
    selection: unselected pages, keys before the window, the tail past the length."""
    k, v = np.array(case.k_pages), np.array(case.v_pages)
    num_kv_heads, _, page_size, _ = k.shape
    tables = np.asarray(case.block_tables)
    for b, n in enumerate(np.asarray(case.lengths)):
        lo = first_visible_key(n, window)
        for h in range(num_kv_heads):
            for p in range(used_pages(n, page_size)):
                pos = p * page_size + np.arange(page_size)
                hidden = (p not in selected[b, h]) | (pos < lo) | (pos >= n)
                k[h, tables[b, p], hidden] = np.nan
                v[h, tables[b, p], hidden] = np.nan
    return case._replace(k_pages=jnp.asarray(k), v_pages=jnp.asarray(v))


def loop_attention(case: Case, selected: np.ndarray, *, sm_scale, soft_cap=None,
                   sliding_window=None) -> np.ndarray:
    """The semantics written out key by key in float64, independent of both implementations."""
    q, k, v = (np.asarray(x, np.float64) for x in case[:3])
    tables = np.asarray(case.block_tables)
    num_kv_heads, _, page_size, _ = k.shape
    group = q.shape[1] // num_kv_heads
    out = np.zeros_like(q)
    for b, n in enumerate(np.asarray(case.lengths)):
        lo = first_visible_key(n, sliding_window)
        for h in range(num_kv_heads):
            keys = [t for p in selected[b, h] if p >= 0
                    for t in range(p * page_size, (p + 1) * page_size) if lo <= t < n]
            if not keys:
                continue
            kk = np.stack([k[h, tables[b, t // page_size], t % page_size] for t in keys])
            vv = np.stack([v[h, tables[b, t // page_size], t % page_size] for t in keys])
            for qh in range(h * group, (h + 1) * group):
                s = kk @ q[b, qh] * sm_scale
                if soft_cap is not None:
                    s = np.tanh(s / soft_cap) * soft_cap
                w = np.exp(s - s.max())
                out[b, qh] = w @ vv / w.sum()
    return out


# (page_size, pages_per_seq, num_kv_heads, group, soft_cap, sliding_window)
# Every page size meets every GQA ratio once; soft cap and windows (below a page, above a page,
# above every length) are spread across them, keeping the interpret-mode compiles few.
CASES = [
    (8, 4, 2, 1, None, None),
    (8, 4, 2, 2, 3.0, 3),
    (8, 5, 1, 4, None, 11),
    (16, 4, 2, 1, 3.0, None),
    (16, 4, 1, 2, None, 5),
    (16, 4, 2, 4, 3.0, 1000),
    (64, 3, 1, 1, None, 70),
    (64, 3, 2, 2, 3.0, None),
    (64, 3, 2, 4, None, None),
]


@pytest.mark.parametrize("page_size,pages_per_seq,num_kv_heads,group,soft_cap,window", CASES)
def test_kernel_matches_reference(seed, page_size, pages_per_seq, num_kv_heads, group, soft_cap,
                                  window):
    rng = np.random.default_rng(seed)
    lengths = varied_lengths(rng, page_size, pages_per_seq)
    case = make_case(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                     num_kv_heads=num_kv_heads, group=group, head_dim=16)
    selected = random_selection(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                                num_kv_heads=num_kv_heads)
    case = poison_invisible(case, selected, window=window)
    knobs = dict(sm_scale=16 ** -0.5, soft_cap=soft_cap, sliding_window=window)
    msg = f"seed={seed} lengths={lengths} knobs={knobs} selected={selected.tolist()}"

    out = np.asarray(sparse_decode_attention(*case, jnp.asarray(selected), **knobs))
    ref = np.asarray(sparse_decode_attention_reference(*case, jnp.asarray(selected), **knobs))
    assert np.isfinite(ref).all(), msg
    tol = attention_tolerance(case, ref)
    np.testing.assert_allclose(out, ref, atol=tol, rtol=0, err_msg=msg)
    np.testing.assert_allclose(ref, loop_attention(case, selected, **knobs), atol=tol, rtol=0, err_msg=msg)
    # (0, kv head 0) selected nothing: its query heads get exact zeros.
    np.testing.assert_array_equal(out[0, :group], 0.0, err_msg=msg)


@pytest.mark.parametrize("page_size,num_kv_heads,group,soft_cap,window",
                         [(8, 2, 2, 3.0, 13), (16, 1, 4, None, None)])
def test_full_selection_equals_dense(seed, page_size, num_kv_heads, group, soft_cap, window):
    """Selecting every used page (some kv heads also select unused ones) is dense paged decode."""
    rng = np.random.default_rng(seed)
    pages_per_seq = 4
    lengths = varied_lengths(rng, page_size, pages_per_seq)
    case = make_case(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                     num_kv_heads=num_kv_heads, group=group, head_dim=16)
    selected = np.full((len(lengths), num_kv_heads, pages_per_seq), -1, np.int32)
    for b, n in enumerate(lengths):
        for h in range(num_kv_heads):
            extra = int(rng.integers(0, pages_per_seq - used_pages(n, page_size) + 1))
            count = used_pages(n, page_size) + extra
            selected[b, h, :count] = np.arange(count)
    knobs = dict(sm_scale=16 ** -0.5, soft_cap=soft_cap, sliding_window=window)
    msg = f"seed={seed} lengths={lengths} knobs={knobs} selected={selected.tolist()}"

    out = np.asarray(sparse_decode_attention(*case, jnp.asarray(selected), **knobs))
    dense_ref = np.asarray(paged_decode_attention_reference(*case, **knobs))
    dense = np.asarray(paged_decode_attention(*case, **knobs))
    assert np.isfinite(dense_ref).all(), msg
    tol = attention_tolerance(case, dense_ref)
    np.testing.assert_allclose(out, dense_ref, atol=tol, rtol=0, err_msg=msg)
    np.testing.assert_allclose(out, dense, atol=tol, rtol=0, err_msg=msg)


def test_bfloat16_matches_float32_reference(seed):
    rng = np.random.default_rng(seed)
    lengths = varied_lengths(rng, 16, 4)
    case = make_case(rng, lengths, page_size=16, pages_per_seq=4, num_kv_heads=2, group=2,
                     head_dim=16)
    selected = random_selection(rng, lengths, page_size=16, pages_per_seq=4, num_kv_heads=2)
    case = poison_invisible(case, selected, window=20)
    knobs = dict(sm_scale=0.25, soft_cap=3.0, sliding_window=20)
    bf16 = Case(*(x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x for x in case))
    out = sparse_decode_attention(*bf16, jnp.asarray(selected), **knobs)
    assert out.dtype == jnp.bfloat16
    # The reference upcasts the same bf16 inputs and stays in float32 throughout.
    ref = sparse_decode_attention_reference(
        *(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in bf16),
        jnp.asarray(selected), **knobs)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=bf16_tolerance(ref), rtol=0,
                               err_msg=f"seed={seed} lengths={lengths} "
                                       f"selected={selected.tolist()}")


def test_length_zero_returns_zeros(seed):
    rng = np.random.default_rng(seed)
    lengths = [0, int(rng.integers(1, 17)), 0, int(rng.integers(17, 33))]
    case = make_case(rng, lengths, page_size=8, pages_per_seq=4, num_kv_heads=2, group=2,
                     head_dim=8)
    # Sequences of length 0 select pages anyway: they hold no visible key, so they are skipped.
    selected = np.tile(np.arange(4, dtype=np.int32), (4, 2, 1))
    out = np.asarray(sparse_decode_attention(*case, jnp.asarray(selected), sm_scale=0.3))
    ref = np.asarray(sparse_decode_attention_reference(*case, jnp.asarray(selected),
                                                       sm_scale=0.3))
    msg = f"seed={seed} lengths={lengths}"
    assert np.isfinite(out).all(), msg
    np.testing.assert_array_equal(out[[0, 2]], 0.0, err_msg=msg)
    np.testing.assert_allclose(out, ref, atol=attention_tolerance(case, ref), rtol=0, err_msg=msg)


STRICT = pltpu.InterpretParams(out_of_bounds_reads="raise")


def _strict_case(rng, window):
    lengths = varied_lengths(rng, 8, 4)
    case = make_case(rng, lengths, page_size=8, pages_per_seq=4, num_kv_heads=2, group=2,
                     head_dim=8)
    selected = random_selection(rng, lengths, page_size=8, pages_per_seq=4, num_kv_heads=2)
    return lengths, case, selected


@pytest.mark.parametrize("window", [None, 9])
def test_never_reads_unselected_pages(seed, window):
    """TPU interpret mode raises on any out-of-bounds read. Every block-table entry no kv head
    may use (unselected by all, past the used pages, wholly before the window) points far outside
    the pool, and each selection is shuffled with garbage in its padding: only the usable
    entries may be looked up, whatever their order."""
    rng = np.random.default_rng(seed)
    lengths, case, selected = _strict_case(rng, window)
    tables = np.array(case.block_tables)
    num_pages = case.k_pages.shape[1]
    for b, n in enumerate(lengths):
        first = first_visible_key(n, window) // 8
        needed = set(selected[b].ravel()) & set(range(first, used_pages(n, 8)))
        for p in range(tables.shape[1]):
            if p not in needed:
                tables[b, p] = num_pages + 1000 + 10 * b + p
    messy = np.where(selected >= 0, selected,
                     rng.choice([-1, -7, 4, 10**6], size=selected.shape)).astype(np.int32)
    messy = rng.permuted(messy, axis=-1)
    case = case._replace(block_tables=jnp.asarray(tables))
    knobs = dict(sm_scale=0.3, sliding_window=window)
    try:
        out = sparse_decode_attention(*case, jnp.asarray(messy), interpret=STRICT, **knobs)
        out = np.asarray(out)
    finally:
        pltpu.reset_tpu_interpret_mode_state()
    ref = np.asarray(sparse_decode_attention_reference(*case, jnp.asarray(selected), **knobs))
    np.testing.assert_allclose(out, ref, atol=attention_tolerance(case, ref), rtol=0,
                               err_msg=f"seed={seed} lengths={lengths} tables={tables} "
                                       f"selected={messy.tolist()}")


def test_out_of_bounds_detection_fires_on_a_selected_page(seed):
    """Control for the test above: a bad entry for a selected, visible page must be caught."""
    rng = np.random.default_rng(seed)
    lengths, case, selected = _strict_case(rng, None)
    selected[1, 0, 0] = 0  # sequence 1 (length >= 1) selects logical page 0 for kv head 0
    tables = np.array(case.block_tables)
    tables[1, 0] = case.k_pages.shape[1] + 7
    case = case._replace(block_tables=jnp.asarray(tables))
    try:
        with pytest.raises(Exception, match="Out-of-bounds"):
            jax.block_until_ready(sparse_decode_attention(
                *case, jnp.asarray(selected), sm_scale=0.3, interpret=STRICT))
    finally:
        pltpu.reset_tpu_interpret_mode_state()


def _valid_sparse_inputs():
    return dict(**_valid_inputs(), selected=jnp.asarray([[[0, 1], [1, -1]], [[-1, -1], [0, 1]]],
                                                        jnp.int32))


BAD_INPUTS = [
    ("selected rank", dict(selected=np.zeros((2, 2), np.int32)), r"selected\.shape=\(2, 2\)"),
    ("selected dtype", dict(selected=np.zeros((2, 2, 2), np.float32)), r"selected\.dtype="),
    ("selected batch", dict(selected=np.zeros((3, 2, 2), np.int32)),
     r"selected\.shape=\(3, 2, 2\) must lead with \(batch=2"),
    ("Hkv mismatch", dict(selected=np.zeros((2, 1, 2), np.int32)),
     r"selected\.shape=\(2, 1, 2\) must lead with .*num_kv_heads=2"),
    ("no slots", dict(selected=np.zeros((2, 2, 0), np.int32)), r"at least one slot"),
    ("q rank (shared check)", dict(q=np.ones((2, 4), np.float32)), r"q\.shape="),
]


@pytest.mark.parametrize("fn", [sparse_decode_attention, sparse_decode_attention_reference],
                         ids=["kernel", "reference"])
@pytest.mark.parametrize("_name,arrays,match", BAD_INPUTS, ids=[c[0] for c in BAD_INPUTS])
def test_validation_errors(fn, _name, arrays, match):
    inputs = {**_valid_sparse_inputs(), **arrays}
    with pytest.raises(ValueError, match=match):
        fn(**inputs, sm_scale=0.3)


def test_validation_accepts_the_valid_inputs():
    """Control for the test above: the unmodified inputs run."""
    out = sparse_decode_attention(**_valid_sparse_inputs(), sm_scale=0.3)
    assert out.shape == (2, 4, 8)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU refusal")
def test_compiled_mode_refused_off_tpu():
    with pytest.raises(NotImplementedError, match="interpret=True"):
        sparse_decode_attention(**_valid_sparse_inputs(), sm_scale=0.3, interpret=False)


@pytest.mark.slow
def test_kernel_matches_reference_larger(seed):
    rng = np.random.default_rng(seed)
    page_size, pages_per_seq, num_kv_heads = 16, 16, 4
    lengths = varied_lengths(rng, page_size, pages_per_seq) + [
        int(rng.integers(1, page_size * pages_per_seq + 1)) for _ in range(2)]
    case = make_case(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                     num_kv_heads=num_kv_heads, group=4, head_dim=64)
    selected = random_selection(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                                num_kv_heads=num_kv_heads)
    case = poison_invisible(case, selected, window=100)
    knobs = dict(sm_scale=64 ** -0.5, soft_cap=20.0, sliding_window=100)
    out = np.asarray(sparse_decode_attention(*case, jnp.asarray(selected), **knobs))
    ref = np.asarray(sparse_decode_attention_reference(*case, jnp.asarray(selected), **knobs))
    np.testing.assert_allclose(out, ref, atol=attention_tolerance(case, ref), rtol=0,
                               err_msg=f"seed={seed} lengths={lengths}")
