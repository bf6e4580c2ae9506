"""The decode kernels over quantized pages (int8 / float8_e4m3fn numbers, one float32 scale per
stored vector): the TPU kernels (interpret mode) and the Triton ones (interpret mode) against the
plain-jnp references with the same scales, on pools where every slot a query may not see holds
random numbers and a NaN scale (so reading one, or its scale, poisons the output).

Every test draws from the dense kernel tests' fixed seed and names it in its failure messages; set
PAGED_DECODE_SEED to try another.
"""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_decode_kernels_gpu import garbage_past_used_pages
from test_paged_decode_kernel import attention_tolerance, make_case, seed, varied_lengths  # noqa: F401 (fixture)
from test_sparse_decode_kernel import poison_invisible, random_selection

from pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference
from pallas_kernels.paged_decode_gpu import paged_decode_attention_gpu
from pallas_kernels.sparse_decode import sparse_decode_attention, sparse_decode_attention_reference
from pallas_kernels.sparse_decode_gpu import sparse_decode_attention_gpu

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def quantize(x: np.ndarray, fmt: str, rng) -> tuple[jnp.ndarray, jnp.ndarray]:
    """Float pages [..., D] with NaN vectors -> (numbers, f32 scales [...]): absmax scale per
    vector; a NaN vector becomes random numbers under a NaN scale."""
    bad = np.isnan(x).any(axis=-1)
    clean = np.where(np.isnan(x), 0, x)
    scale = np.abs(clean).max(axis=-1) / QMAX[fmt]
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    y = clean / scale[..., None]
    if fmt == "int8":
        data = np.clip(np.round(y), -127, 127).astype(np.int8)
        data[bad] = rng.integers(-127, 128, size=data[bad].shape, dtype=np.int8)
    else:
        data = y.astype(ml_dtypes.float8_e4m3fn)
        data[bad] = rng.normal(size=data[bad].shape).astype(ml_dtypes.float8_e4m3fn)
    scale[bad] = np.nan
    return jnp.asarray(data), jnp.asarray(scale)


def quantized_case(seed, fmt, *, page_size, pages_per_seq, num_kv_heads, group, head_dim, sparse=False):
    rng = np.random.default_rng(seed)
    lengths = varied_lengths(rng, page_size, pages_per_seq)
    case = make_case(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                     num_kv_heads=num_kv_heads, group=group, head_dim=head_dim)
    selected = None
    if sparse:
        selected = random_selection(rng, lengths, page_size=page_size, pages_per_seq=pages_per_seq,
                                    num_kv_heads=num_kv_heads)
        case = poison_invisible(case, selected, window=None)
        selected = jnp.asarray(selected)
    k, ks = quantize(np.asarray(case.k_pages), fmt, rng)
    v, vs = quantize(np.asarray(case.v_pages), fmt, rng)
    case = garbage_past_used_pages(case._replace(k_pages=k, v_pages=v))
    return case, selected, {"k_scales": ks, "v_scales": vs}, f"seed={seed} {fmt} lengths={lengths}"


def check(out, ref, msg, scales, case, reference, *args, **knobs):
    ref = np.asarray(ref, np.float32)
    assert np.isfinite(ref).all(), msg
    tol = attention_tolerance(case, ref)  # both read the numbers times their scales in float32
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, atol=tol, rtol=0, err_msg=msg)
    # The scales matter: read as if every scale were 1, the output moves (a kernel that dropped
    # them could not have matched).
    ones = {k: jnp.where(jnp.isnan(s), s, 1.0) for k, s in scales.items()}
    unscaled = np.asarray(reference(*case, *args, **knobs, **ones), np.float32)
    moved_by = float(np.abs(unscaled - ref).max())
    assert moved_by > 10 * tol, f"{msg}: unscaled reads moved the output by {moved_by:.3g} only"


@pytest.mark.parametrize("fmt,page_size,group,soft_cap,window,ppcb", [
    ("int8", 8, 2, None, None, 2), ("float8_e4m3fn", 16, 1, 3.0, 11, 1)])
def test_tpu_paged_kernel_reads_quantized_pages(seed, fmt, page_size, group, soft_cap, window, ppcb):
    case, _, scales, msg = quantized_case(seed, fmt, page_size=page_size, pages_per_seq=4, num_kv_heads=2,
                                          group=group, head_dim=16)
    knobs = dict(sm_scale=16 ** -0.5, soft_cap=soft_cap, sliding_window=window)
    out = paged_decode_attention(*case, pages_per_compute_block=ppcb, platform="tpu", **knobs, **scales)
    ref = paged_decode_attention_reference(*case, **knobs, **scales)
    check(out, ref, msg, scales, case, paged_decode_attention_reference, **knobs)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_tpu_sparse_kernel_reads_quantized_pages(seed, fmt):
    case, selected, scales, msg = quantized_case(seed, fmt, page_size=8, pages_per_seq=5, num_kv_heads=2,
                                                 group=2, head_dim=16, sparse=True)
    knobs = dict(sm_scale=16 ** -0.5)
    out = sparse_decode_attention(*case, selected, platform="tpu", **knobs, **scales)
    ref = sparse_decode_attention_reference(*case, selected, **knobs, **scales)
    check(out, ref, msg, scales, case, sparse_decode_attention_reference, selected, **knobs)


@pytest.mark.parametrize("fmt", ["int8", "float8_e4m3fn"])
def test_gpu_kernels_read_quantized_pages(seed, fmt):
    """The Triton kernels in interpret mode (page 16, head_dim 64, GQA 4, split-K)."""
    case, _, scales, msg = quantized_case(seed, fmt, page_size=16, pages_per_seq=6, num_kv_heads=2,
                                          group=4, head_dim=64)
    knobs = dict(sm_scale=64 ** -0.5, soft_cap=3.0)
    out = paged_decode_attention_gpu(*case, pages_per_step=2, k_splits=2, interpret=True, **knobs, **scales)
    ref = paged_decode_attention_reference(*case, **knobs, **scales)
    check(out, ref, msg + " paged", scales, case, paged_decode_attention_reference, **knobs)
    case, selected, scales, msg = quantized_case(seed + 1, fmt, page_size=16, pages_per_seq=6, num_kv_heads=2,
                                                 group=4, head_dim=64, sparse=True)
    out = sparse_decode_attention_gpu(*case, selected, pages_per_step=2, k_splits=2, interpret=True, **knobs,
                                      **scales)
    ref = sparse_decode_attention_reference(*case, selected, **knobs, **scales)
    check(out, ref, msg + " sparse", scales, case, sparse_decode_attention_reference, selected, **knobs)


def test_quantized_inputs_are_checked_by_name():
    rng = np.random.default_rng(0)
    case, _, scales, _ = quantized_case(1, "int8", page_size=8, pages_per_seq=2, num_kv_heads=1, group=1,
                                        head_dim=16)
    knobs = dict(sm_scale=0.25)
    with pytest.raises(ValueError, match="k_scales and v_scales"):
        paged_decode_attention_reference(*case, **knobs)  # int8 pages without their scales
    with pytest.raises(ValueError, match="come together"):
        paged_decode_attention_reference(*case, **knobs, k_scales=scales["k_scales"])
    with pytest.raises(ValueError, match="k_scales"):
        paged_decode_attention_reference(*case, **knobs, k_scales=scales["k_scales"][..., :-1],
                                         v_scales=scales["v_scales"])
    floats = case._replace(k_pages=jnp.asarray(rng.normal(size=case.k_pages.shape), jnp.float32),
                           v_pages=jnp.asarray(rng.normal(size=case.k_pages.shape), jnp.float32))
    with pytest.raises(ValueError, match="int8"):  # scales beside float pages
        paged_decode_attention_reference(*floats, **knobs, **scales)
