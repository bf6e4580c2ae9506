"""Page digests: a small summary of each page's keys, per kv head, kept on device for every page.

Kinds (R = digest rows per page):
  minmax (R = 2): per-dimension min and max of the page's keys (Quest). q.k <= sum_d max(q_d lo_d,
                  q_d hi_d) for every key k in the page, so the score is an upper bound.
  mean   (R = 1): the mean key of the page; the score q.mean is the page's average logit.

Digests are recomputed from the pool for the pages a call wrote to (a partial page included),
so they are always exactly the digest of the page's current valid keys.
"""

from __future__ import annotations

import jax.numpy as jnp

from gemini_jax.attention import kvquant
from gemini_jax.attention.views import Span
from gemini_jax.model.layers import rope_angles, rotate

ROWS = {"minmax": 2, "mean": 1}


def create(kind: str, num_layers: int, kv_heads: int, num_pages: int, head_dim: int, dtype):
    return jnp.zeros((num_layers, kv_heads, num_pages, ROWS[kind], head_dim), dtype)


def page_digest(kind: str, keys, count):
    """keys [..., S, D], count [...] valid slots -> digest [..., R, D] (float32 math)."""
    S = keys.shape[-2]
    valid = (jnp.arange(S) < count[..., None])[..., None]
    kf = keys.astype(jnp.float32)
    if kind == "minmax":
        lo = jnp.min(jnp.where(valid, kf, jnp.inf), axis=-2)
        hi = jnp.max(jnp.where(valid, kf, -jnp.inf), axis=-2)
        empty = (count == 0)[..., None]
        return jnp.stack([jnp.where(empty, 0.0, lo), jnp.where(empty, 0.0, hi)], axis=-2)
    mean = jnp.sum(jnp.where(valid, kf, 0.0), axis=-2) / jnp.maximum(count, 1)[..., None].astype(jnp.float32)
    return mean[..., None, :]


def update(kind: str, digests, k_pool, layer, span: Span, unrope=None):
    """Recompute the digests of the pages that `span.positions` [B, T] touched in `layer`.

    `unrope` (the rope's inv_freq, for `sparse.score_distance`): digest the keys as they were
    before rope (each rotated back by its own position), so a page can be scored at any distance.

    A call of T tokens touches at most T // S + 2 logical pages per row; only those are read.
    Pages are read from `k_pool` through `span.tables`; digests are written through
    `span.page_ids` (default: the same tables). They differ under tiers: the pool is a set of
    device slots, while digests are kept for every page id.
    """
    positions, lengths, block_tables, digest_tables = span.positions, span.lengths, span.tables, span.page_ids
    S = k_pool.shape[3]
    P = k_pool.shape[2]
    B, T = positions.shape
    n_touch = T // S + 2
    first = positions[:, 0] // S
    logical = first[:, None] + jnp.arange(n_touch)[None, :]  # [B, n]
    in_table = logical < block_tables.shape[1]
    phys = jnp.take_along_axis(block_tables, jnp.clip(logical, 0, block_tables.shape[1] - 1), axis=1)
    count = jnp.clip(lengths[:, None] - logical * S, 0, S)  # valid slots per touched page
    if span.fill is not None:  # syntax-aligned pages: a page's padding is not digested
        count = jnp.minimum(count, jnp.take_along_axis(span.fill, jnp.clip(logical, 0, span.fill.shape[1] - 1), axis=1))
    last_written = positions[:, -1:] // S
    touched = in_table & (logical <= last_written) & (count > 0)
    # Quantized keys are digested as they read back: a digest recomputed from the pool stays the
    # exact digest of the page's current keys through rewinds, forks and restores.
    pages = kvquant.read(k_pool[layer][:, phys], jnp.float32)  # [K, B, n, S, D]
    if unrope is not None:
        cos, sin = rope_angles(-(logical[:, :, None] * S + jnp.arange(S)), unrope)  # [B, n, S, D]
        pages = rotate(pages.astype(jnp.float32), cos, sin)
    dig = page_digest(kind, pages, jnp.broadcast_to(count[None], pages.shape[:3]))  # [K, B, n, R, D]
    if digest_tables is not None:
        P = digests.shape[2]
        phys = jnp.take_along_axis(digest_tables, jnp.clip(logical, 0, block_tables.shape[1] - 1), axis=1)
    phys = jnp.where(touched, phys, P)  # untouched -> out of range -> dropped
    # Advanced indices split by a slice put [B, n] first: the update is [B, n, K, R, D].
    return digests.at[layer, :, phys].set(jnp.moveaxis(dig, 0, 2).astype(digests.dtype), mode="drop")
