"""Attention over selected pages (XLA path; the Pallas kernel is pallas_kernels.sparse_decode).

Equal to dense paged attention restricted to the selected pages: keys keep their true
positions, so causality and sliding windows mask exactly as in the dense path.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gemini_jax.attention import kvquant
from gemini_jax.attention.views import PageView, Selection, slot_valid
from gemini_jax.model.layers import NEG_INF, rope_angles, rotate, softcap


def sparse_attention(queries, kv_layer, view: PageView, sel: Selection, *, scale: float, cap=None, window=0,
                     return_lse: bool = False):
    """queries = (q [B, T, H, D], q_pos [B, T]), kv_layer = (k, v) pools [K, P, S, D] of one layer,
    view = (tables i32[B, W], lengths i32[B]), sel.pages i32[B, K, n] -> [B, T, H, D].

    `sel.shift` i32[B, K, n] (with the rope's `sel.inv_freq`): move each selected page's keys by
    that many positions before attending (rope rotations compose: rotating a key stored at
    position p by s gives the key at p + s). Masks keep using the true positions.

    With return_lse, also the log-sum-exp of each query's (masked) logits, f32[B, T, H]: the
    weight with which this part merges with attention over other pages (`merge_parts`).
    """
    q, q_pos = queries
    k_layer, v_layer = kv_layer
    block_tables, lengths = view.tables, view.lengths
    selected, page_shift, inv_freq = sel
    B, T, H, D = q.shape
    K, P, S, _ = k_layer.shape
    n = selected.shape[-1]
    logical = jnp.maximum(selected, 0)
    phys = jnp.take_along_axis(block_tables[:, None, :], logical, axis=2)  # [B, K, n]
    heads = jnp.arange(K)[None, :, None]
    kk = kvquant.read(k_layer[heads, phys], q.dtype)  # [B, K, n, S, D]
    vv = kvquant.read(v_layer[heads, phys], q.dtype)
    k_pos = (logical[..., None] * S + jnp.arange(S)).reshape(B, K, n * S)
    ok = ((selected >= 0)[..., None] & jnp.ones((S,), bool)).reshape(B, K, n * S)
    ok = ok & (k_pos < lengths[:, None, None])
    held = slot_valid(view.fill, logical, S)  # syntax-aligned pages: padding slots masked
    if held is not None:
        ok = ok & held.reshape(B, K, n * S)
    diff = q_pos[:, None, :, None] - k_pos[:, :, None, :]  # [B, K, T, nS]
    mask = ok[:, :, None, :] & (diff >= 0) & ((window <= 0) | (diff < window))
    qg = q.reshape(B, T, K, H // K, D)
    kk = kk.reshape(B, K, n * S, D)
    vv = vv.reshape(B, K, n * S, D)
    G = H // K
    if page_shift is not None and T * G <= S:
        # A few queries (decode): turn each query once per page by -shift instead of the page's S
        # keys by +shift (q.R(a)k = R(-a)q.k). XLA fuses the angles' cos / sin into the rotation
        # and recomputes them per element it writes, so the work follows the rotated operand's
        # size: G x T per page here against S keys there.
        cos, sin = rope_angles(page_shift, inv_freq)  # [B, K, n, D] (rope_angles takes any leading shape)
        qf = jnp.moveaxis(qg.astype(jnp.float32), 1, 3)[:, :, :, :, None]  # [B, K, G, T, 1, D]
        q_turned = rotate(qf, cos[:, :, None, None], -sin[:, :, None, None])  # [B, K, G, T, n, D]
        s = jnp.einsum("bkgtnd,bknsd->bkgtns", q_turned.astype(q.dtype), kk.reshape(B, K, n, S, D),
                       preferred_element_type=jnp.float32).reshape(B, K, G, T, n * S) * scale
    else:
        if page_shift is not None:
            shift = jnp.repeat(page_shift, S, axis=-1)  # [B, K, nS]
            cos, sin = rope_angles(shift, inv_freq)  # [B, K, nS, D]
            kk = rotate(kk.astype(jnp.float32), cos, sin).astype(q.dtype)
        s = jnp.einsum("btkgd,bksd->bkgts", qg, kk, preferred_element_type=jnp.float32) * scale
    s = softcap(s, cap)
    s = jnp.where(mask[:, :, None], s, NEG_INF)
    p = jax.nn.softmax(s, axis=-1)
    # Zero V where masked: a masked slot may hold anything (even NaN in a poisoned test pool).
    vv = jnp.where(ok[..., None], vv, 0)
    out = jnp.einsum("bkgts,bksd->btkgd", p.astype(vv.dtype), vv, preferred_element_type=jnp.float32)
    out = out.reshape(B, T, H, D).astype(q.dtype)
    if not return_lse:
        return out
    # A query with no valid key here gets -inf, so it weighs nothing in the merge.
    any_ok = jnp.any(mask, axis=-1)[:, :, None]  # [B, K, 1, T]
    lse = jnp.where(any_ok, jax.nn.logsumexp(s, axis=-1), -jnp.inf)  # [B, K, G, T]
    return out, jnp.moveaxis(lse, 3, 1).reshape(B, T, H)


def merge_parts(out_a, lse_a, out_b, lse_b):
    """Attention over pages A and over disjoint pages B -> attention over A and B (log-sum-exp
    weights). A part with lse -inf contributes nothing, so merging into an empty accumulator
    (lse -inf) returns the other part unchanged, bit for bit."""
    m = jnp.maximum(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(m), m, 0.0)
    wa, wb = jnp.exp(lse_a - safe), jnp.exp(lse_b - safe)
    tot = wa + wb
    out = (out_a.astype(jnp.float32) * (wa / tot)[..., None] + out_b.astype(jnp.float32) * (wb / tot)[..., None])
    lse = jnp.where(jnp.isfinite(m), safe + jnp.log(tot), -jnp.inf)
    return out.astype(out_a.dtype), lse
