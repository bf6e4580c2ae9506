"""The paged KV pool on device and the KV backend that reads it.

Layout per layer is jax's Pallas one, `[kv_heads, num_pages, block_size, head_dim]`; the pool
stacks layers in front, `[layers, kv_heads, num_pages, block_size, head_dim]`, so the decoder's
layer scan carries it and updates one layer in place.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gemini_jax.config import ModelConfig
from gemini_jax.model import layers as L


class PagedKV(NamedTuple):
    """Device state of one call: the pool plus this call's boundary metadata."""

    k: jax.Array  # [layers, kv_heads, num_pages, block_size, head_dim]
    v: jax.Array
    block_tables: jax.Array  # i32[B, pages_per_seq]
    lengths: jax.Array  # i32[B]: valid tokens per sequence once this call's tokens are written

    @staticmethod
    def create_pool(cfg: ModelConfig, num_pages: int, block_size: int, dtype):
        shape = (cfg.num_layers, cfg.num_kv_heads, num_pages, block_size, cfg.head_dim)
        # Zeros: the null page (0) is read under a mask, and 0 * NaN would poison outputs.
        return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


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
    k_pool = k_pool.at[layer, :, page, slot].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[layer, :, page, slot].set(v.astype(v_pool.dtype), mode="drop")
    return k_pool, v_pool


def gather_pages(pool_layer, block_tables):
    """[K, P, S, D] pages of the block tables -> contiguous [B, W * S, K, D]."""
    g = pool_layer[:, block_tables]  # [K, B, W, S, D]
    K, B, W, S, D = g.shape
    return g.transpose(1, 2, 3, 0, 4).reshape(B, W * S, K, D)


def paged_backend(cfg: ModelConfig, impl: str = "xla", interpret=None):
    """KV backend over the paged pool. impl 'xla': gather pages, then dense attention (the CPU
    fast path, any number of query tokens). impl 'pallas': decode steps (one query token) go
    through `pallas_kernels.paged_decode`; prefill chunks use the XLA path."""
    windows = sorted(set(cfg.layer_windows))

    def attend(layer, q, k, v, q_pos, window, cache: PagedKV):
        k_pool, v_pool = write_pages(cache.k, cache.v, layer, k, v, q_pos, cache.block_tables,
                                     cache.lengths)
        cache = cache._replace(k=k_pool, v=v_pool)
        if impl == "pallas" and q.shape[1] == 1:
            return _pallas_decode(q, k_pool[layer], v_pool[layer], cache, window), cache
        kk = gather_pages(k_pool[layer], cache.block_tables)
        vv = gather_pages(v_pool[layer], cache.block_tables)
        k_pos = jnp.broadcast_to(jnp.arange(kk.shape[1], dtype=jnp.int32), kk.shape[:2])
        valid = k_pos < cache.lengths[:, None]
        mask = L.attention_mask(q_pos, k_pos, valid, window)
        out = L.dense_attention(q, kk.astype(q.dtype), vv.astype(q.dtype), mask,
                                scale=cfg.scale, cap=cfg.attn_softcap)
        return out, cache

    def _pallas_decode(q, kp, vp, cache, window):
        from pallas_kernels.paged_decode import paged_decode_attention

        # The kernel takes its window statically; layers differ (Gemma), so switch on it.
        def branch(w):
            return lambda: paged_decode_attention(
                q[:, 0], kp, vp, cache.block_tables, cache.lengths, sm_scale=cfg.scale,
                soft_cap=cfg.attn_softcap, sliding_window=(w or None), interpret=interpret)[:, None]

        if len(windows) == 1:
            return branch(windows[0])()
        idx = sum(jnp.where(window == w, i, 0) for i, w in enumerate(windows))
        return jax.lax.switch(idx, [branch(w) for w in windows])

    return attend


@jax.jit
def copy_pages(k_pool, v_pool, src, dst):
    """Copy whole pages src[i] -> dst[i] in every layer (copy-on-write of partial pages)."""
    return (k_pool.at[:, :, dst].set(k_pool[:, :, src]), v_pool.at[:, :, dst].set(v_pool[:, :, src]))
