"""Next-token selection: greedy, temperature, top-k, top-p, with explicit PRNG keys.

The key of a token is a pure function of (seed, sequence index, position), so a run that is
interrupted and resumed, or re-run from a prefix, draws the same tokens.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gemini_jax.config import SamplingParams


def token_keys(seed: int, seq_ids, positions):
    """PRNG keys [B] for the tokens at `positions` [B] of sequences `seq_ids` [B]."""
    return keys_from(jax.random.key(seed), seq_ids, positions)


def keys_from(base, seq_ids, positions):
    """`token_keys` from the seed's key `base` (jax.random.key(seed)), e.g. inside a program."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.fold_in(base, s), p))(seq_ids, positions)


@functools.partial(jax.jit, static_argnames=("temperature", "top_k", "top_p"))
def sample(logits, keys, *, temperature: float, top_k: int = 0, top_p: float = 1.0):
    """logits f32[B, V], keys [B] -> int32[B]. temperature 0 = greedy (argmax)."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k:
        kth = jax.lax.top_k(logits, min(top_k, logits.shape[-1]))[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        cutoff_idx = jnp.sum(cum < top_p, axis=-1, keepdims=True)
        cutoff = jnp.take_along_axis(sorted_logits, cutoff_idx, axis=-1)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.vmap(jax.random.categorical)(keys, logits).astype(jnp.int32)


def sample_with(params: SamplingParams, logits, seq_ids, positions):
    keys = token_keys(params.seed, jnp.asarray(seq_ids, jnp.uint32), jnp.asarray(positions, jnp.uint32))
    return sample(logits, keys, temperature=float(params.temperature), top_k=int(params.top_k),
                  top_p=float(params.top_p))
