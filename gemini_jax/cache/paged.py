"""The paged KV pool on device and the KV backend that reads it.

Layout per layer is jax's Pallas one, `[kv_heads, num_pages, block_size, head_dim]`; the pool
stacks layers in front, `[layers, kv_heads, num_pages, block_size, head_dim]`, so the decoder's
layer scan carries it and updates one layer in place.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from gemini_jax.attention import digests as page_digests
from gemini_jax.attention import kvquant
from gemini_jax.attention.select import compact_shift, select_step
from gemini_jax.attention.dispatch import AttentionImpl, attend_pages, attend_selected
from gemini_jax.attention.views import PageView, Selection, Span
from gemini_jax.config import ModelConfig, SparseConfig
from gemini_jax.errors import ConfigError
from gemini_jax.model import layers


class PagedKV(NamedTuple):
    """Device state of one call: the pool plus this call's boundary metadata."""

    k: jax.Array  # [layers, kv_heads, num_pages, block_size, head_dim]
    v: jax.Array
    block_tables: jax.Array  # i32[B, pages_per_seq]
    lengths: jax.Array  # i32[B]: valid tokens per sequence once this call's tokens are written
    digests: Optional[jax.Array] = None  # [layers, kv_heads, num_pages, R, head_dim] (sparse only)
    page_reads: Optional[jax.Array] = None  # i32[]: (page, kv head) pairs attention read, all layers
    key_reads: Optional[jax.Array] = None  # i32[]: (page, kv head) pairs whose keys alone were read (rerank)
    page_fill: Optional[jax.Array] = None  # i32[B, pages_per_seq]: cache.align=syntax (PageView.fill); None: off


def write_pages(k_pool, v_pool, layer, k, v, positions, block_tables, lengths):
    """Scatter new K/V [B, T, K, D] at `positions` [B, T] into their pages.

    Positions at or past `lengths` (padding of a prefill chunk) are dropped, so padding never
    touches a page (shared prefix pages included).
    """
    S = k_pool.shape[3]
    P = k_pool.shape[2]
    logical = jnp.clip(positions // S, 0, block_tables.shape[1] - 1)
    page = jnp.take_along_axis(block_tables, logical, axis=1)
    page = jnp.where(positions < lengths[:, None], page, P)  # P is out of range -> dropped
    slot = positions % S
    # A quantized pool stores each token's vector with its own scale (kvquant): written once, never re-rounded.
    k_pool = kvquant.write(k_pool, (layer, slice(None), page, slot), k, mode="drop")
    v_pool = kvquant.write(v_pool, (layer, slice(None), page, slot), v, mode="drop")
    return k_pool, v_pool


def write_layer(k_pool, v_pool, digests, layer, kv_new, span: Span, *, digest_kind=None, unrope=None):
    """The first half of every runner's layer body: this call's K/V (`kv_new` = (k, v) [B, T, K, D])
    into their pages, then the digests of the pages they touched (`digest_kind` None: no
    digests). -> (k_pool, v_pool, digests)."""
    k, v = kv_new
    k_pool, v_pool = write_pages(k_pool, v_pool, layer, k, v, span.positions, span.tables, span.lengths)
    if digest_kind is not None:
        digests = page_digests.update(digest_kind, digests, k_pool, layer, span, unrope=unrope)
    return k_pool, v_pool, digests


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
    if compact and cfg.local_rope is not None:
        raise ConfigError("sparse.positions='compact' re-rotates keys with the model's rope; this family has "
                          "a second (local) rope, which is not supported: use positions='true'.")
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
