"""The attention policy over pages, in one place: the paged KV backend the model's layers call
(`paged_backend`: write, select, attend) and how attention over pages runs: XLA (gather + dense,
one query per row on a CPU, or the selected pages), the Pallas kernels (`pallas_kernels`, decode
steps: one query per row; the TPU or the GPU (Triton) variant), and compact positions (keys moved
by rope, XLA only: the kernels keep true positions). The choice among them is made once, when the
engine builds its `AttentionImpl`.

Every runner's layer body ends here: the pooled cache inside the model's layers, the tiered
runner layer by layer, and the one-program tiered decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from gemini_jax.attention import kvquant
from gemini_jax.attention.paged_decode import decode_over_pages
from gemini_jax.attention.pool import PagedKV, write_layer
from gemini_jax.attention.select import compact_shift, select_step
from gemini_jax.attention.sparse import sparse_attention
from gemini_jax.attention.views import PageView, Selection, Span, slot_valid
from gemini_jax.config import ModelConfig, SparseConfig
from gemini_jax.model import layers
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.sparse_decode import sparse_decode_attention

IMPLS = ("xla", "pallas")
KERNEL_PLATFORMS = (None, "tpu", "gpu")


@dataclass(frozen=True, kw_only=True)
class AttentionImpl:
    """Static choice of the attention path (hashable). `impl` "xla" is the portable path (fast
    on CPU); "pallas" runs decode steps through the kernels (compiled on GPU / TPU, interpret
    mode on CPU). `windows`: the model's distinct sliding windows (the kernels take the window
    statically, so a step switches among them). `platform`: which kernel variant "pallas" runs,
    see `kernel_platform`. `decode_rows`: a one-query step on the XLA path runs row by row, chunk
    by chunk (`paged_decode.decode_over_pages`, the CPU's fast path) instead of gathering the pages.
    `platform` and `decode_rows` left None are resolved from the running backend when the spec is
    built, so a traced step never asks the backend which path to take."""

    impl: str = "xla"
    scale: float
    cap: Optional[float] = None
    windows: tuple = (0,)
    interpret: Optional[bool] = None
    platform: Optional[str] = None
    decode_rows: Optional[bool] = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} must be one of {IMPLS}.")
        if self.platform not in KERNEL_PLATFORMS:
            raise ValueError(f"platform={self.platform!r} must be one of {KERNEL_PLATFORMS}.")
        backend = jax.default_backend()
        if self.platform is None and self.impl == "pallas":
            # On a GPU the Triton kernels, on a TPU the TPU ones; on CPU None: the kernels' own
            # default there (the TPU kernels in interpret mode).
            platform = "gpu" if backend in ("gpu", "cuda", "rocm") else "tpu" if backend == "tpu" else None
            object.__setattr__(self, "platform", platform)
        if self.decode_rows is None:
            object.__setattr__(self, "decode_rows", self.impl == "xla" and backend == "cpu")

    @classmethod
    def of(cls, cfg: ModelConfig, impl: str = "xla", interpret=None, platform=None) -> "AttentionImpl":
        return cls(impl=impl, scale=cfg.scale, cap=cfg.attn_softcap, windows=tuple(sorted(set(cfg.layer_windows))),
                   interpret=interpret, platform=platform)


def gather_pages(pool_layer, block_tables, dtype):
    """[K, P, S, D] pages of the block tables -> contiguous [B, W * S, K, D] in `dtype`."""
    g = kvquant.read(pool_layer[:, block_tables], dtype)  # [K, B, W, S, D]
    K, B, W, S, D = g.shape
    return g.transpose(1, 2, 3, 0, 4).reshape(B, W * S, K, D)


def attend_pages(spec: AttentionImpl, queries, kv_layer, view: PageView, window, layer=None):
    """Dense attention of queries = (q [B, T, H, D], q_pos [B, T]) over every page of the view's
    tables in kv_layer = (k, v) [K, P, S, D] -> [B, T, H, D]. With `layer` (i32[]), kv_layer is
    the whole pool [L, K, P, S, D] (the CPU decode path then reads the layer's pages from it
    without copying the layer: `paged_decode.decode_over_pages`)."""
    q, q_pos = queries
    if q.shape[1] == 1 and spec.decode_rows:
        # One query per row on a CPU: row by row, chunk by chunk (see `paged_decode`).
        return decode_over_pages(queries, kv_layer, view, window, scale=spec.scale, cap=spec.cap, layer=layer)
    if layer is not None:
        kv_layer = (kv_layer[0][layer], kv_layer[1][layer])
    k_layer, v_layer = kv_layer
    if spec.impl == "pallas" and q.shape[1] == 1 and view.fill is None:
        (k, ks), (v, vs) = kvquant.kernel_operands(k_layer), kvquant.kernel_operands(v_layer)
        return _by_window(spec, window, lambda w: lambda: paged_decode_attention(
            q[:, 0], k, v, view.tables, view.lengths, sm_scale=spec.scale, soft_cap=spec.cap,
            sliding_window=(w or None), interpret=spec.interpret, platform=spec.platform,
            k_scales=ks, v_scales=vs)[:, None])
    kk = gather_pages(k_layer, view.tables, q.dtype)
    vv = gather_pages(v_layer, view.tables, q.dtype)
    k_pos = jnp.broadcast_to(jnp.arange(kk.shape[1], dtype=jnp.int32), kk.shape[:2])
    valid = k_pos < view.lengths[:, None]
    held = slot_valid(view.fill, jnp.broadcast_to(jnp.arange(view.tables.shape[1]), view.tables.shape),
                      k_layer.shape[2])
    if held is not None:  # syntax-aligned pages: their padding slots are masked
        valid = valid & held.reshape(valid.shape)
    mask = layers.attention_mask(q_pos, k_pos, valid, window)
    return layers.dense_attention(q, kk, vv, mask, scale=spec.scale, cap=spec.cap)


def attend_selected(spec: AttentionImpl, queries, kv_layer, view: PageView, sel: Selection, window, *,
                    return_lse: bool = False):
    """Attention over the selected pages only (equal to `attend_pages` restricted to them). With
    return_lse (XLA path), also the log-sum-exp that merges it with attention over other pages."""
    q, _ = queries
    if spec.impl == "pallas" and q.shape[1] == 1 and sel.shift is None and not return_lse and view.fill is None:
        (k, ks), (v, vs) = kvquant.kernel_operands(kv_layer[0]), kvquant.kernel_operands(kv_layer[1])
        return _by_window(spec, window, lambda w: lambda: sparse_decode_attention(
            q[:, 0], k, v, view.tables, view.lengths, sel.pages, sm_scale=spec.scale,
            soft_cap=spec.cap, sliding_window=(w or None), interpret=spec.interpret,
            platform=spec.platform, k_scales=ks, v_scales=vs)[:, None])
    return sparse_attention(queries, kv_layer, view, sel, scale=spec.scale, cap=spec.cap, window=window,
                            return_lse=return_lse)


def _by_window(spec: AttentionImpl, window, make):
    """Kernels take the window statically; layers differ (Gemma), so switch on it."""
    if len(spec.windows) == 1:
        return make(spec.windows[0])()
    idx = sum(jnp.where(window == w, i, 0) for i, w in enumerate(spec.windows))
    return jax.lax.switch(idx, [make(w) for w in spec.windows])


def paged_backend(cfg: ModelConfig, impl: str = "xla", sparse: SparseConfig | None = None, interpret=None,
                  kernel_platform=None):
    """KV backend over the paged pool.

    impl 'xla': gather pages, then dense attention (the CPU fast path, any number of queries).
    impl 'pallas': decode steps (one query) go through `pallas_kernels`; prefill chunks use XLA
    (`gemini_jax.attention.dispatch` decides). With `sparse.enabled`, digests are kept for every
    written page, and decode steps (and prefill chunks, with sparse_prefill) attend only to the
    selected pages.
    """
    spec = AttentionImpl.of(cfg, impl, interpret, platform=kernel_platform)
    sp = sparse if sparse is not None and sparse.enabled else None
    compact = sp is not None and sp.positions == "compact"
    inv_freq = layers.inv_frequencies(cfg.rope, cfg.head_dim) if compact else None
    unrope = inv_freq if compact and sp.score_distance > 0 else None  # digests of keys before rope

    def attend(layer, q, k, v, q_pos, window, cache: PagedKV):
        k_pool, v_pool, dig = write_layer(cache.k, cache.v, cache.digests, layer, (k, v),
                                          Span(q_pos, cache.lengths, cache.block_tables, fill=cache.page_fill),
                                          digest_kind=None if sp is None else sp.digest, unrope=unrope)
        cache = cache._replace(k=k_pool, v=v_pool, digests=dig)
        T = q.shape[1]
        if sp is not None and (T == 1 or sp.sparse_prefill):
            if sp.dense_layers > 0:
                out, reads, key_reads = jax.lax.cond(layer < sp.dense_layers,
                                                     lambda: dense(layer, q, q_pos, window, cache),
                                                     lambda: sparse_step(layer, q, q_pos, window, cache))
            else:
                out, reads, key_reads = sparse_step(layer, q, q_pos, window, cache)
        else:
            out, reads, key_reads = dense(layer, q, q_pos, window, cache)
        if cache.page_reads is not None:
            cache = cache._replace(page_reads=cache.page_reads + reads)
        if cache.key_reads is not None:
            cache = cache._replace(key_reads=cache.key_reads + key_reads)
        return out, cache

    def dense(layer, q, q_pos, window, cache):
        B, W = cache.block_tables.shape
        reads = jnp.int32(B * W * cfg.num_kv_heads)  # the gather path reads the whole table
        out = attend_pages(spec, (q, q_pos), (cache.k, cache.v), PageView(cache.block_tables, cache.lengths, cache.page_fill), window,
                           layer=layer)
        return out, reads, jnp.int32(0)

    def sparse_step(layer, q, q_pos, window, cache):
        view = PageView(cache.block_tables, cache.lengths, cache.page_fill)
        selected, candidates = select_step(sp, cache.digests[layer], (q, q_pos), view, block_size=cache.k.shape[3],
                                           window=window, inv_freq=inv_freq, k_layer=cache.k[layer])
        reads = jnp.sum(selected >= 0).astype(jnp.int32)
        # Reranking read every candidate's keys (the chosen pages' keys are read again to attend).
        key_reads = jnp.sum(candidates >= 0).astype(jnp.int32) if sp.rerank else jnp.int32(0)
        sel = Selection(selected, compact_shift(selected, cache.k.shape[3]), inv_freq) if compact else Selection(selected)
        out = attend_selected(spec, (q, q_pos), (cache.k[layer], cache.v[layer]), view, sel, window)
        return out, reads, key_reads

    return attend
