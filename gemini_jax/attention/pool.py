"""The paged pool's device state in a call (`PagedKV`) and how a call's K/V are written into it.

Layout per layer is jax's Pallas one, `[kv_heads, num_pages, block_size, head_dim]`; the pool
stacks layers in front, `[layers, kv_heads, num_pages, block_size, head_dim]`, so a layer's
write updates one layer in place. `write_layer` is the first half of every runner's layer body
(the pooled cache inside the model, the tiered runner layer by layer, the one-program tiered
step); the second half is `attention.dispatch`.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp

from gemini_jax.attention import digests as page_digests
from gemini_jax.attention import kvquant
from gemini_jax.attention.views import Span


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
