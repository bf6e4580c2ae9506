"""Attention over selected pages (XLA path; the Pallas kernel is pallas_kernels.sparse_decode).

Equal to dense paged attention restricted to the selected pages: keys keep their true
positions, so causality and sliding windows mask exactly as in the dense path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gemini_jax.model.layers import NEG_INF, softcap


def sparse_attention(q, q_pos, k_layer, v_layer, block_tables, lengths, selected, *, scale: float,
                     cap=None, window=0):
    """q [B, T, H, D], q_pos [B, T], pools [K, P, S, D], selected i32[B, K, n] -> [B, T, H, D]."""
    B, T, H, D = q.shape
    K, P, S, _ = k_layer.shape
    n = selected.shape[-1]
    logical = jnp.maximum(selected, 0)
    phys = jnp.take_along_axis(block_tables[:, None, :], logical, axis=2)  # [B, K, n]
    heads = jnp.arange(K)[None, :, None]
    kk = k_layer[heads, phys]  # [B, K, n, S, D]
    vv = v_layer[heads, phys]
    k_pos = (logical[..., None] * S + jnp.arange(S)).reshape(B, K, n * S)
    ok = ((selected >= 0)[..., None] & jnp.ones((S,), bool)).reshape(B, K, n * S)
    ok = ok & (k_pos < lengths[:, None, None])
    diff = q_pos[:, None, :, None] - k_pos[:, :, None, :]  # [B, K, T, nS]
    mask = ok[:, :, None, :] & (diff >= 0) & ((window <= 0) | (diff < window))
    qg = q.reshape(B, T, K, H // K, D)
    kk = kk.reshape(B, K, n * S, D).astype(q.dtype)
    vv = vv.reshape(B, K, n * S, D).astype(q.dtype)
    s = jnp.einsum("btkgd,bksd->bkgts", qg, kk, preferred_element_type=jnp.float32) * scale
    s = softcap(s, cap)
    s = jnp.where(mask[:, :, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    # Zero V where masked: a masked slot may hold anything (even NaN in a poisoned test pool).
    vv = jnp.where(ok[..., None], vv, 0)
    out = jnp.einsum("bkgts,bksd->btkgd", p.astype(vv.dtype), vv, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, D).astype(q.dtype)
