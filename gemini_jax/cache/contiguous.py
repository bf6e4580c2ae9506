"""The contiguous dense KV cache: one [max_seq_len] buffer per batch row and layer.

This is the reference cache the paged cache is measured against: simple, exact, and wasteful
(every row reserves max_seq_len positions; attention reads the whole buffer under a mask).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from gemini_jax.attention import kvquant
from gemini_jax.config import ModelConfig
from gemini_jax.model import layers


class ContiguousKV(NamedTuple):
    k: jax.Array  # [layers, rows, max_seq_len, kv_heads, head_dim] (or kvquant.QuantPages)
    v: jax.Array
    rows: jax.Array  # i32[B]: cache row of each batch entry of the current call

    @staticmethod
    def create(cfg: ModelConfig, num_rows: int, max_seq_len: int, dtype) -> "ContiguousKV":
        shape = (cfg.num_layers, num_rows, max_seq_len, cfg.num_kv_heads, cfg.head_dim)
        # Zeros, not empty: masked-out positions are multiplied by probability 0, and 0 * NaN
        # would poison the output.
        return ContiguousKV(kvquant.zeros(shape, dtype), kvquant.zeros(shape, dtype), jnp.zeros((1,), jnp.int32))

    def bytes_per_read(self, batch: int) -> int:
        """KV bytes one decode step reads: every layer reads its rows' full buffers."""
        _, _, S, K, D = self.k.shape
        return 2 * self.k.shape[0] * batch * S * K * kvquant.vector_bytes(self.k.dtype, D)


def contiguous_backend(cfg: ModelConfig):
    """KV backend writing new K/V at their positions, then attending over the row's buffer."""

    def attend(layer, q, k, v, q_pos, window, cache: ContiguousKV):
        rows = cache.rows[:, None]
        # Positions past the buffer (padding of the last prefill chunk) are dropped.
        k_all = kvquant.write(cache.k, (layer, rows, q_pos), k, mode="drop")
        v_all = kvquant.write(cache.v, (layer, rows, q_pos), v, mode="drop")
        k_rows = kvquant.read(k_all[layer][cache.rows], q.dtype)
        v_rows = kvquant.read(v_all[layer][cache.rows], q.dtype)
        S = k_rows.shape[1]
        k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (q.shape[0], S))
        mask = layers.attention_mask(q_pos, k_pos, jnp.ones_like(k_pos, bool), window)
        out = layers.dense_attention(q, k_rows, v_rows, mask,
                                scale=cfg.scale, cap=cfg.attn_softcap)
        return out, cache._replace(k=k_all, v=v_all)

    return attend
