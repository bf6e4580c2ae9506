"""pallas_kernels.paged_decode_gpu / sparse_decode_gpu: the Triton kernels, run in interpret mode
on CPU, against the jnp references of the TPU kernels (same semantics).

Pools come from the dense kernel's tests (`make_case`: random physical pages, NaN in unused
pages and in the tails of partly filled last pages); block-table entries past a sequence's used
pages point far outside the pool; for the sparse kernel every K/V slot its kv head's selection
does not let the query see is NaN too. So a key the kernel fails to mask shows up as NaN or
as a wrong value. (Interpret mode cannot see whether a masked load touches memory; the compiled
kernel reads nothing a mask excludes, and its loop bounds come from the lengths / counts.)

Every test draws from the dense kernel tests' fixed seed and names it in its failure messages; set
PAGED_DECODE_SEED to try another.
"""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from pallas_kernels.paged_decode_gpu import paged_decode_attention_gpu
from pallas_kernels.sparse_decode import sparse_decode_attention_reference
from pallas_kernels.sparse_decode_gpu import sparse_decode_attention_gpu
from test_paged_decode_kernel import (Case, _valid_inputs, attention_tolerance, bf16_tolerance, make_case,
                                      varied_lengths)
from test_paged_decode_kernel import seed  # noqa: F401  (the pytest fixture, used by name)
from test_sparse_decode_kernel import poison_invisible, random_selection, used_pages


def garbage_past_used_pages(case: Case) -> Case:
    """Block-table entries past each sequence's used pages -> far out of the pool's range."""
    tables = np.array(case.block_tables)
    num_pages = case.k_pages.shape[1]
    for b, n in enumerate(np.asarray(case.lengths)):
        tables[b, used_pages(n, case.k_pages.shape[2]):] = num_pages + 10**6 + b
    return case._replace(block_tables=jnp.asarray(tables))


def draw(seed, page_size, pages_per_seq, num_kv_heads, group, head_dim):
    rng = np.random.default_rng(seed)
    lengths = varied_lengths(rng, page_size, pages_per_seq)
    case = make_case(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                     num_kv_heads=num_kv_heads, group=group, head_dim=head_dim)
    return rng, lengths, garbage_past_used_pages(case)


def as_dtype(case: Case, dtype) -> Case:
    return Case(*(x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x for x in case))


def compare(out, ref, dtype, msg, case):
    out = np.asarray(out, np.float32)
    assert np.isfinite(ref).all(), msg
    tol = attention_tolerance(case, ref) if dtype == jnp.float32 else bf16_tolerance(ref)
    np.testing.assert_allclose(out, ref, atol=tol, rtol=0, err_msg=msg)


# (page_size, pages_per_seq, num_kv_heads, group, head_dim, soft_cap, window, dtype,
#  pages_per_step, k_splits). Every block size in 16..256 and GQA 1/2/4/8 appear, head_dim 64 and
# 128, f32 and bf16; windows below, inside and above a page; split counts that leave some splits
# empty and steps that run past a split's last page. The last case has odd shapes (group 7 as
# Qwen2.5, head_dim 48, page 8) that the kernel pads to powers of two.
CASES = [
    (16, 6, 2, 1, 64, None, None, jnp.float32, 2, 3),
    (32, 4, 1, 2, 128, 3.0, 40, jnp.float32, 1, 2),
    (64, 3, 2, 4, 64, None, 70, jnp.bfloat16, 1, None),
    (128, 2, 1, 8, 64, 3.0, None, jnp.float32, 1, 2),
    (256, 2, 1, 2, 128, None, 300, jnp.bfloat16, None, None),
    (16, 8, 2, 8, 128, 3.0, 5, jnp.float32, 4, 2),
    (8, 5, 1, 7, 48, 3.0, 11, jnp.float32, 2, 2),
]
IDS = [f"S{c[0]}-G{c[3]}-D{c[4]}-{jnp.dtype(c[7]).name}" for c in CASES]


def check_dense(seed, page_size, pages_per_seq, num_kv_heads, group, head_dim, soft_cap, window,
                dtype, pages_per_step, k_splits):
    _, lengths, case = draw(seed, page_size, pages_per_seq, num_kv_heads, group, head_dim)
    knobs = dict(sm_scale=head_dim ** -0.5, soft_cap=soft_cap, sliding_window=window)
    out = paged_decode_attention_gpu(*as_dtype(case, dtype), pages_per_step=pages_per_step,
                                     k_splits=k_splits, **knobs)
    assert out.dtype == dtype
    # The reference reads the same (rounded) inputs in float32 and stays in float32.
    ref = np.asarray(paged_decode_attention_reference(
        *as_dtype(as_dtype(case, dtype), jnp.float32), **knobs))
    compare(out, ref, dtype, f"seed={seed} lengths={lengths} knobs={knobs} "
                             f"{pages_per_step=} {k_splits=}", case)


def check_sparse(seed, page_size, pages_per_seq, num_kv_heads, group, head_dim, soft_cap, window,
                 dtype, pages_per_step, k_splits):
    rng, lengths, case = draw(seed, page_size, pages_per_seq, num_kv_heads, group, head_dim)
    selected = random_selection(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                                num_kv_heads=num_kv_heads)
    case = poison_invisible(case, selected, window=window)
    knobs = dict(sm_scale=head_dim ** -0.5, soft_cap=soft_cap, sliding_window=window)
    msg = (f"seed={seed} lengths={lengths} knobs={knobs} {pages_per_step=} {k_splits=} "
           f"selected={selected.tolist()}")
    out = sparse_decode_attention_gpu(*as_dtype(case, dtype), jnp.asarray(selected),
                                      pages_per_step=pages_per_step, k_splits=k_splits, **knobs)
    assert out.dtype == dtype
    ref = np.asarray(sparse_decode_attention_reference(
        *as_dtype(as_dtype(case, dtype), jnp.float32), jnp.asarray(selected), **knobs))
    compare(out, ref, dtype, msg, case)
    # (0, kv head 0) selected nothing: its query heads get exact zeros.
    np.testing.assert_array_equal(np.asarray(out, np.float32)[0, :group], 0.0, err_msg=msg)


@pytest.mark.parametrize("params", CASES, ids=IDS)
def test_paged_gpu_kernel_matches_reference(seed, params):
    check_dense(seed, *params)


@pytest.mark.parametrize("params", CASES, ids=IDS)
def test_sparse_gpu_kernel_matches_reference(seed, params):
    check_sparse(seed, *params)


SWEEP = [(s, w, 2, g, d, cap, win, dt, None, None)
         for (s, w), g, d, (cap, win), dt in itertools.product(
             [(16, 9), (32, 5), (64, 4), (128, 3), (256, 2)], [1, 2, 4, 8], [64, 128],
             [(None, None), (5.0, 37)], [jnp.float32, jnp.bfloat16])]


@pytest.mark.slow
@pytest.mark.parametrize("params", SWEEP, ids=[f"S{c[0]}-G{c[3]}-D{c[4]}-cap{c[5]}-"
                                               f"{jnp.dtype(c[7]).name}" for c in SWEEP])
def test_gpu_kernels_sweep(seed, params):
    check_dense(seed, *params)
    check_sparse(seed, *params)


def test_sparse_full_selection_equals_dense(seed):
    """Selecting every used page (and some unused ones) is the dense GPU kernel's result."""
    page_size, pages_per_seq, num_kv_heads, group, head_dim = 16, 4, 2, 4, 64
    rng, lengths, case = draw(seed, page_size, pages_per_seq, num_kv_heads, group, head_dim)
    selected = np.full((len(lengths), num_kv_heads, pages_per_seq), -1, np.int32)
    for b, n in enumerate(lengths):
        for h in range(num_kv_heads):
            count = used_pages(n, page_size) + int(
                rng.integers(0, pages_per_seq - used_pages(n, page_size) + 1))
            selected[b, h, :count] = np.arange(count)
    knobs = dict(sm_scale=0.125, soft_cap=3.0, sliding_window=21)
    dense = np.asarray(paged_decode_attention_gpu(*case, k_splits=2, **knobs))
    sparse = np.asarray(sparse_decode_attention_gpu(*case, jnp.asarray(selected), k_splits=2,
                                                    **knobs))
    msg = f"seed={seed} lengths={lengths} selected={selected.tolist()}"
    assert np.isfinite(dense).all(), msg
    np.testing.assert_allclose(sparse, dense, atol=attention_tolerance(case, dense), rtol=0, err_msg=msg)


def test_empty_sequences_return_zeros(seed):
    rng = np.random.default_rng(seed)
    lengths = [0, int(rng.integers(1, 17)), 0, int(rng.integers(17, 49))]
    case = garbage_past_used_pages(make_case(rng, lengths, page_size=16, pages_per_seq=3,
                                             num_kv_heads=1, group=2, head_dim=64))
    selected = jnp.asarray(np.tile(np.arange(3, dtype=np.int32), (4, 1, 1)))
    msg = f"seed={seed} lengths={lengths}"
    dense = np.asarray(paged_decode_attention_gpu(*case, sm_scale=0.125, k_splits=2))
    sparse = np.asarray(sparse_decode_attention_gpu(*case, selected, sm_scale=0.125, k_splits=2))
    ref = np.asarray(paged_decode_attention_reference(*case, sm_scale=0.125))
    for out in (dense, sparse):
        assert np.isfinite(out).all(), msg
        np.testing.assert_array_equal(out[[0, 2]], 0.0, err_msg=msg)
        np.testing.assert_allclose(out, ref, atol=attention_tolerance(case, ref), rtol=0, err_msg=msg)


@pytest.mark.parametrize("knobs,match", [
    (dict(pages_per_step=3), r"pages_per_step=3 must be"),
    (dict(k_splits=0), r"k_splits=0 must be"),
    (dict(num_warps=0), r"num_warps=0 must be"),
    (dict(sliding_window=0), r"sliding_window=0"),  # the shared checks run too
])
def test_gpu_knob_validation(knobs, match):
    with pytest.raises(ValueError, match=match):
        paged_decode_attention_gpu(**_valid_inputs(), **{"sm_scale": 0.3, **knobs})


def test_tpu_interpret_params_refused_for_gpu_kernel():
    from jax.experimental.pallas import tpu as pltpu

    with pytest.raises(ValueError, match="TPU interpret mode"):
        paged_decode_attention(**_valid_inputs(), sm_scale=0.3, platform="gpu",
                               interpret=pltpu.InterpretParams())
