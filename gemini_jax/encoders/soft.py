"""The decoder run on embeddings instead of token ids, so soft tokens (projected encoder vectors) can sit
between ordinary tokens.

`embeds_logits` is `Decoder.__call__` with its first step (the token embedding) taken out and no KV
cache: the same per-layer halves (`layer_qkv`, `layer_finish`), the same dense self-attention mask
and the same final norm and head, so `forward_embeds(model, model.embed_tokens(t))` equals
`gemini_jax.forward(model, t)` (tests/test_encoders.py checks it). Layers run in a Python loop,
not a scan: the decoders here are shallow, and a static index lets each layer read its own window.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemini_jax.errors import ContextLengthError
from gemini_jax.model import Decoder
from gemini_jax.model import layers


def embeds_logits(model: Decoder, embeds: jax.Array, positions: jax.Array) -> jax.Array:
    """Dense, cache-free forward of embeddings f32[B, T, d_model] at positions int32[B, T]
    -> logits f32[B, T, vocab]. Pure and traceable (use it inside jit / grad)."""
    cfg = model.cfg
    h = embeds.astype(jnp.dtype(cfg.dtype))
    valid = jnp.ones(positions.shape, bool)
    for idx in range(cfg.num_layers):
        q, k, v = model.layer_qkv(idx, h, positions)
        mask = layers.attention_mask(positions, positions, valid, jnp.int32(cfg.layer_windows[idx]))
        attn = layers.dense_attention(q, k, v, mask, scale=cfg.scale, cap=cfg.attn_softcap)
        h = model.layer_finish(idx, h, attn)
    return model.logits(h)


@functools.partial(jax.jit, static_argnums=0)
def _forward_embeds_jit(graphdef, state, embeds, positions):
    return embeds_logits(nnx.merge(graphdef, state), embeds[None], positions[None])[0]


def forward_embeds(model: Decoder, embeds, positions=None) -> jax.Array:
    """Logits f32[T, vocab] of one sequence of embeddings f32[T, d_model] (positions int32[T],
    default 0..T-1); dense attention, no cache. Jitted.

    Raises ContextLengthError when a position is negative or reaches the model's `max_position`.
    """
    embeds = jnp.asarray(embeds)
    if embeds.ndim != 2 or embeds.shape[1] != model.cfg.hidden_size:
        raise ValueError(f"embeds must be [T, {model.cfg.hidden_size}]; got {list(embeds.shape)}.")
    if positions is None:
        positions = np.arange(embeds.shape[0], dtype=np.int32)
    positions = np.asarray(positions, np.int32)
    if positions.shape != embeds.shape[:1]:
        raise ValueError(f"positions must be [{embeds.shape[0]}]; got {list(positions.shape)}.")
    if positions.size and (positions.min() < 0 or positions.max() >= model.cfg.max_position):
        raise ContextLengthError(f"positions span {positions.min()}..{positions.max()}; the model takes "
                                 f"0..{model.cfg.max_position - 1}.")
    return _forward_embeds_jit(*nnx.split(model), embeds, jnp.asarray(positions))


def soft_prompt(model: Decoder, soft: jax.Array, before, after, *, max_context: int | None = None) -> jax.Array:
    """Embeddings f32[B, len(before) + n + len(after), d_model] of `before` tokens, then the soft tokens
    f32[B, n, d_model], then `after` tokens (token ids, the same for every row). Traceable.

    Raises ContextLengthError when the sequence is longer than `max_context` (default: the model's
    `max_position`), naming how many soft tokens would fit.
    """
    before, after = np.asarray(before, np.int32), np.asarray(after, np.int32)
    limit = model.cfg.max_position if max_context is None else int(max_context)
    total = len(before) + soft.shape[1] + len(after)
    if total > limit:
        room = max(0, limit - len(before) - len(after))
        raise ContextLengthError(f"{soft.shape[1]} soft tokens + {len(before) + len(after)} text tokens = {total} "
                                 f"exceed max_context={limit}; at most {room} soft tokens fit around this text.")
    batch = soft.shape[0]
    parts = [jnp.broadcast_to(model.embed_tokens(jnp.asarray(ids)), (batch, len(ids), soft.shape[2]))
             for ids in (before, after)]
    return jnp.concatenate([parts[0], soft.astype(parts[0].dtype), parts[1]], axis=1)
