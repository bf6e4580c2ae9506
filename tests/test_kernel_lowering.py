"""The GPU kernels compile for CUDA from this CPU host: every decode-attention call the engine can
issue with attention_impl="pallas" on a GPU (each shipped model preset's heads, head_dim, soft
cap and sliding windows; every cache dtype; block sizes 8..256; dense and sparse) is traced
through `gemini_jax.attention.dispatch` and lowered with `lowering_platforms=("cuda",)`, and the
lowered module must hold one Triton custom call of the GPU kernel per distinct window.

This stops at Pallas -> Triton IR (what jax does on a CPU host); Triton's own compile to PTX
happens on the GPU (experiments/gpu_check.sh).
"""

from __future__ import annotations

import glob
import os
import re

import jax
import jax.numpy as jnp
import pytest
import yaml

from gemini_jax import config
from gemini_jax.attention import dispatch
from gemini_jax.attention.views import PageView, Selection
from pallas_kernels.paged_decode import paged_decode_attention, paged_decode_attention_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON_CALL = re.compile(r'custom_call @__gpu\$xla\.gpu\.triton\(.*?name = "([^"]+)"')
CACHE_DTYPES = config.DTYPES
BLOCK_SIZES = (8, 16, 32, 64, 128, 256)


def preset(path: str) -> config.ModelConfig:
    """A conf/model preset as the engine gets it (Hydra's `gj_windows` resolver applied)."""
    text = open(path).read()
    text = re.sub(r"\$\{gj_windows:(\d+),(\d+),(\d+)\}",
                  lambda m: str(config.windows_spec(*map(int, m.groups()))), text)
    data = yaml.safe_load(text)
    data.pop("defaults", None)
    return config.from_dict(config.ModelConfig, data)


PRESETS = {os.path.basename(p)[:-5]: preset(p)
           for p in sorted(glob.glob(os.path.join(ROOT, "conf", "model", "*.yaml")))}


def triton_kernels(lowered) -> list[str]:
    """Names of the Triton kernels (custom calls) in a lowered module."""
    return TRITON_CALL.findall(lowered.as_text())


def assert_gpu_kernel(lowered, kernel: str, count: int) -> None:
    names = triton_kernels(lowered)
    assert len(names) == count and all(n.startswith(kernel) for n in names), (
        f"expected {count} Triton call(s) of {kernel}, found {names}")


def decode_call(cfg: config.ModelConfig, *, sparse: bool, dtype: str, block_size: int,
                impl: str = "pallas", platform: str | None = "gpu"):
    """(function, abstract args) of one decode step's attention as the engine's layer issues it."""
    spec = dispatch.AttentionImpl.of(cfg, impl, interpret=False, platform=platform)
    batch, pages_per_seq, num_pages, slots = 2, 4, 9, 3
    dt = jnp.dtype(dtype)
    q = jax.ShapeDtypeStruct((batch, 1, cfg.num_heads, cfg.head_dim), dt)
    q_pos = jax.ShapeDtypeStruct((batch, 1), jnp.int32)
    pages = jax.ShapeDtypeStruct((cfg.num_kv_heads, num_pages, block_size, cfg.head_dim), dt)
    tables = jax.ShapeDtypeStruct((batch, pages_per_seq), jnp.int32)
    lengths = jax.ShapeDtypeStruct((batch,), jnp.int32)
    window = jax.ShapeDtypeStruct((), jnp.int32)  # per layer, traced inside the layer scan
    if sparse:
        selected = jax.ShapeDtypeStruct((batch, cfg.num_kv_heads, slots), jnp.int32)

        def fn(q, q_pos, k, v, tables, lengths, selected, window):
            return dispatch.attend_selected(spec, (q, q_pos), (k, v), PageView(tables, lengths),
                                            Selection(selected), window)

        return fn, (q, q_pos, pages, pages, tables, lengths, selected, window)

    def fn(q, q_pos, k, v, tables, lengths, window):
        return dispatch.attend_pages(spec, (q, q_pos), (k, v), PageView(tables, lengths), window)

    return fn, (q, q_pos, pages, pages, tables, lengths, window)


def lower_for_cuda(fn, args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


CONFIGS = [(name, sparse, dtype, BLOCK_SIZES[i % len(BLOCK_SIZES)])
           for i, (name, dtype) in enumerate((n, d) for n in PRESETS for d in CACHE_DTYPES)
           for sparse in (False, True)]


@pytest.mark.parametrize("name,sparse,dtype,block_size", CONFIGS,
                         ids=[f"{n}-{'sparse' if s else 'dense'}-{d}-S{b}" for n, s, d, b in CONFIGS])
def test_engine_decode_attention_lowers_to_triton(name, sparse, dtype, block_size):
    cfg = PRESETS[name]
    fn, args = decode_call(cfg, sparse=sparse, dtype=dtype, block_size=block_size)
    kernel = "sparse_decode_gpu" if sparse else "paged_decode_gpu"
    assert_gpu_kernel(lower_for_cuda(fn, args), kernel, count=len(set(cfg.layer_windows)))


def test_presets_cover_the_kernel_knobs():
    """The configurations above include soft-capping, several windows, GQA groups that are not a
    power of two, and head_dim 64, 128 and 256 (so the test above spans what the engine issues)."""
    cfgs = PRESETS.values()
    assert any(c.attn_softcap for c in cfgs)
    assert any(len(set(c.layer_windows)) > 1 for c in cfgs)
    assert any(min(c.layer_windows) > 0 for c in cfgs)
    assert any((c.num_heads // c.num_kv_heads) & (c.num_heads // c.num_kv_heads - 1) for c in cfgs)
    assert {64, 128, 256} <= {c.head_dim for c in cfgs}


def test_backend_gpu_selects_the_gpu_kernels(monkeypatch):
    """With no platform set, dispatch follows the running backend: on a GPU it issues the Triton
    kernels (seen here by reporting a GPU backend and lowering for CUDA)."""
    cfg = PRESETS["gemma2_9b"]
    # Whatever this test runs on (CI's CPU or a GPU machine), each backend is reported in turn.
    # The spec resolves the path when it is built (a traced step never asks the backend).
    monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
    assert dispatch.AttentionImpl.of(cfg, "pallas").platform is None
    assert dispatch.AttentionImpl.of(cfg, "xla").decode_rows, "CPU: one query per row runs row by row"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    spec = dispatch.AttentionImpl.of(cfg, "pallas")
    assert spec.platform == "gpu" and not spec.decode_rows
    assert not dispatch.AttentionImpl.of(cfg, "xla").decode_rows, "GPU: the XLA path gathers the pages"
    fn, args = decode_call(cfg, sparse=False, dtype="bfloat16", block_size=16, platform=None)
    assert_gpu_kernel(lower_for_cuda(fn, args), "paged_decode_gpu", count=2)


def test_public_entry_point_with_platform_gpu_lowers_to_triton():
    args = (jax.ShapeDtypeStruct((3, 8, 128), jnp.bfloat16),
            *[jax.ShapeDtypeStruct((2, 7, 16, 128), jnp.bfloat16)] * 2,
            jax.ShapeDtypeStruct((3, 5), jnp.int32), jax.ShapeDtypeStruct((3,), jnp.int32))
    lowered = lower_for_cuda(lambda *a: paged_decode_attention(
        *a, sm_scale=0.1, soft_cap=30.0, sliding_window=50, platform="gpu", interpret=False), args)
    assert_gpu_kernel(lowered, "paged_decode_gpu", count=1)


def test_check_fails_without_the_kernel():
    """Controls: the check above rejects the XLA path, the jnp reference, and the wrong kernel."""
    cfg = PRESETS["llama3_1_8b"]
    fn, args = decode_call(cfg, sparse=False, dtype="bfloat16", block_size=16, impl="xla")
    xla = lower_for_cuda(fn, args)
    with pytest.raises(AssertionError, match="found \\[\\]"):
        assert_gpu_kernel(xla, "paged_decode_gpu", count=1)
    q, _, k, v, tables, lengths, _ = args
    q = jax.ShapeDtypeStruct((q.shape[0], *q.shape[2:]), q.dtype)  # [B, Hq, D]: one query each
    reference = lower_for_cuda(lambda *a: paged_decode_attention_reference(*a, sm_scale=0.1),
                               (q, k, v, tables, lengths))
    with pytest.raises(AssertionError, match="found \\[\\]"):
        assert_gpu_kernel(reference, "paged_decode_gpu", count=1)
    fn, args = decode_call(cfg, sparse=False, dtype="bfloat16", block_size=16)
    with pytest.raises(AssertionError, match="paged_decode_gpu"):
        assert_gpu_kernel(lower_for_cuda(fn, args), "sparse_decode_gpu", count=1)
