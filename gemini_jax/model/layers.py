"""Pure building blocks of the decoder: norms, rotary embeddings, activations, dense attention.

Shapes: B batch, T new tokens, S key positions, H query heads, K kv heads, D head_dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax.config import RopeConfig

NEG_INF = -1e30  # finite: keeps fully-masked rows NaN-free


def rms_norm(x, w, eps: float, plus_one: bool):
    """RMSNorm computed in float32. Gemma scales by (1 + w), the others by w."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    wf = w.astype(jnp.float32)
    if plus_one:
        return (xf * (1.0 + wf)).astype(x.dtype)
    return (wf * xf.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)


def activation(name: str):
    if name == "silu":
        return jax.nn.silu
    if name == "gelu_tanh":
        return lambda x: jax.nn.gelu(x, approximate=True)
    return lambda x: jax.nn.gelu(x, approximate=False)


def inv_frequencies(rope: RopeConfig, head_dim: int) -> np.ndarray:
    """Rotary inverse frequencies f32[D/2], with linear or llama3 context scaling."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (1.0 / (np.float32(rope.theta) ** exponents)).astype(np.float32)
    if rope.kind == "linear":
        inv = inv / np.float32(rope.factor)
    elif rope.kind == "llama3":
        old = rope.original_max_position
        low_wavelen = old / rope.low_freq_factor
        high_wavelen = old / rope.high_freq_factor
        wavelen = 2 * np.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (old / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv = np.where(medium, smoothed, scaled).astype(np.float32)
    return inv


def rope_angles(positions, inv_freq):
    """cos, sin f32[B, T, D] for int positions [B, T] (half-rotation layout, as HF)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)[None, None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x, cos, sin):
    """x [B, T, H, D]; cos/sin [B, T, D]."""
    return rotate(x, cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype))


def rotate(x, cos, sin):
    """Rope rotation of x [..., D] by angles whose cos/sin broadcast against x (half-rotation
    layout). Rotations compose: rotating a key roped at p by the angles of s gives it at p + s."""
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1) * sin


def softcap(x, cap):
    return x if cap is None else jnp.tanh(x / cap) * cap


def attention_mask(q_pos, k_pos, k_valid, window):
    """bool[B, T, S]: causal, valid keys only, within the sliding window (0 = full).

    NOTE: a window of W lets position p see keys p - W < k <= p (the current token and W - 1
    before it), the convention of the model families we load.
    """
    diff = q_pos[:, :, None] - k_pos[:, None, :]
    mask = (diff >= 0) & k_valid[:, None, :]
    return mask & ((window <= 0) | (diff < window))


def dense_attention(q, k, v, mask, *, scale: float, cap=None):
    """Grouped-query attention. q [B,T,H,D], k/v [B,S,K,D], mask bool[B,T,S] -> [B,T,H,D]."""
    B, T, H, D = q.shape
    K = k.shape[2]
    qg = q.reshape(B, T, K, H // K, D)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    scores = softcap(scores, cap)
    scores = jnp.where(mask[:, None, None, :, :], scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, H, D).astype(q.dtype)
