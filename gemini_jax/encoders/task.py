"""The question the projectors are trained on: [BOS] + soft tokens + " The digit is ", whose next byte
should be the digit's character. The decoder is byte-level (token id = byte value), so the answer
is one token, and greedy decoding answers right exactly when that byte is the argmax.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax.data.tasks import BOS
from gemini_jax.encoders.projector import Projector
from gemini_jax.encoders.soft import embeds_logits, soft_prompt
from gemini_jax.model import Decoder

QUESTION = " The digit is "
BEFORE = np.array([BOS], np.int32)                                     # as the shipped prompts start
AFTER = np.frombuffer(QUESTION.encode(), np.uint8).astype(np.int32)
ZERO = ord("0")


def answer_token(labels) -> np.ndarray:
    """The byte that answers digit `labels` (int[N] -> int32[N])."""
    return (ZERO + np.asarray(labels)).astype(np.int32)


def answer_logits(model: Decoder, projector: Projector, vectors: jax.Array, *,
                  max_context: int | None = None) -> jax.Array:
    """Next-token logits f32[N, vocab] after [BOS] + projector(vectors) + QUESTION, for encoder vectors
    f32[N, n, d_enc]. Traceable. Raises ContextLengthError as `soft_prompt` does."""
    embeds = soft_prompt(model, projector(vectors), BEFORE, AFTER, max_context=max_context)
    positions = jnp.broadcast_to(jnp.arange(embeds.shape[1], dtype=jnp.int32), embeds.shape[:2])
    return embeds_logits(model, embeds, positions)[:, -1]
