"""Decode attention (one query per row) over every page of the block tables, on the XLA path.

The general path (`dispatch.attend_pages` for prefill chunks) gathers a row's pages into one
[B, W*S, K, D] buffer and runs `layers.dense_attention`. For a single query that costs several
times the bytes it must read on a CPU: the gathered copy of every page is written and read
again from memory, and the score product has the layout XLA runs slowest. Measured on the
2-core CPU, one layer at 16K context: 17 ms against 0.7 ms to read the same K and V once.

Here each row is attended on its own (`lax.map`) and its pages in chunks of `CHUNK_PAGES`
(`lax.scan`, online softmax): a chunk's gathered K and V stay in cache between the gather and
the two products, and the products are laid out [kv head, keys, group] so each is a plain
matrix product. Same softmax, summed in parts: equal to `dense_attention` up to rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gemini_jax.attention import kvquant
from gemini_jax.model import layers

CHUNK_PAGES = 64  # pages per chunk: 64 x 16 tokens x 64 dims x 4 bytes = 256 KiB of K per kv head


def decode_over_pages(queries, kv_layer, view, window, *, scale: float, cap=None, chunk_pages: int = CHUNK_PAGES,
                      layer=None):
    """queries = (q [B, 1, H, D], q_pos [B, 1]), kv_layer = (k, v) [K, P, S, D], view = (tables
    i32[B, W], lengths i32[B]) -> [B, 1, H, D]. With `layer` (i32[]), kv_layer is the whole pool
    (k, v) [L, K, P, S, D] and each chunk is gathered from that layer of it.

    NOTE: pass the whole pool with `layer` inside a loop over layers: a layer sliced out of the
    pool and then read inside this function's loops is copied whole ([K, P, S, D]) every call,
    which makes a step's cost grow with the pool rather than with the pages it reads."""
    q, q_pos = queries
    k_layer, v_layer = kv_layer
    tables, lengths, fill = view.tables, view.lengths, view.fill
    B, _, H, D = q.shape
    K, _, S, _ = k_layer.shape[-4:]

    def pages_of(pool, pages):  # [K, C, S, D] in the queries' dtype (quantized pages read back)
        if layer is None:
            return kvquant.read(pool[:, pages], q.dtype)
        # NOTE: a scalar and an array index split by a slice put the indexed axis first: [C, K, S, D].
        return jnp.swapaxes(kvquant.read(pool[layer, :, pages], q.dtype), 0, 1)
    G = H // K
    W = tables.shape[1]
    C = min(chunk_pages, W)
    n_chunks = -(-W // C)
    # Padding pages are the null page at positions >= lengths: masked.
    tables = jnp.pad(tables, ((0, 0), (0, n_chunks * C - W))).reshape(B, n_chunks, C)
    # Syntax-aligned pages (`PageView.fill`): slots past a page's fill are padding, masked. Without
    # fills the program is the one of fixed pages (no extra operand, no extra compare).
    if fill is not None:
        fill = jnp.pad(fill, ((0, 0), (0, n_chunks * C - W)), constant_values=S).reshape(B, n_chunks, C)

    def row(args):
        qr, pos, table, length, fills = args  # [H, D], [], [n_chunks, C], [], [n_chunks, C] or None
        qg = qr.reshape(K, G, D)

        def chunk(carry, xs):
            m, l, acc = carry  # [K, G], [K, G], [K, G, D]
            pages, c, page_fill = xs if fills is not None else (*xs, None)
            kk = pages_of(k_layer, pages).reshape(K, C * S, D)
            vv = pages_of(v_layer, pages).reshape(K, C * S, D)
            s = jax.lax.dot_general(kk, qg, (((2,), (2,)), ((0,), (0,))),
                                    preferred_element_type=jnp.float32) * scale  # [K, C*S, G]
            s = layers.softcap(s, cap)
            k_pos = c * C * S + jnp.arange(C * S, dtype=jnp.int32)
            diff = pos - k_pos
            ok = (k_pos < length) & (diff >= 0) & ((window <= 0) | (diff < window))  # [C*S]
            if page_fill is not None:
                ok = ok & (jnp.arange(S)[None, :] < page_fill[:, None]).reshape(C * S)
            s = jnp.where(ok[None, :, None], s, layers.NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(ok[None, :, None], jnp.exp(s - m_new[:, None, :]), 0.0)
            alpha = jnp.exp(m - m_new)
            l = l * alpha + jnp.sum(p, axis=1)
            # Zero V where masked: a masked slot may hold anything (even NaN in a poisoned pool).
            vv = jnp.where(ok[None, :, None], vv, 0)
            pv = jax.lax.dot_general(p.astype(vv.dtype), vv, (((1,), (1,)), ((0,), (0,))),
                                     preferred_element_type=jnp.float32)  # [K, G, D]
            return (m_new, l, acc * alpha[..., None] + pv), None

        init = (jnp.full((K, G), layers.NEG_INF, jnp.float32), jnp.zeros((K, G), jnp.float32),
                jnp.zeros((K, G, D), jnp.float32))
        xs = (table, jnp.arange(n_chunks, dtype=jnp.int32)) + (() if fills is None else (fills,))
        (m, l, acc), _ = jax.lax.scan(chunk, init, xs)
        return (acc / jnp.maximum(l, 1e-30)[..., None]).reshape(H, D)

    out = jax.lax.map(row, (q[:, 0], q_pos[:, 0], tables, lengths, fill))  # fill None: an empty pytree
    return out[:, None].astype(q.dtype)
