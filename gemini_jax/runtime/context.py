"""What every runner reads, built once by the engine: the model (graph + weights), the configs,
the page manager, the KV store and the whole-model jitted step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import jax.numpy as jnp
from flax import nnx

from gemini_jax.config import EngineConfig, ModelConfig


@dataclass(frozen=True, kw_only=True)
class RunContext:
    """`pages` (host page bookkeeping) and `store` (device KV) are None for the contiguous cache;
    `step(params, cache, tokens, positions, select) -> (logits f32[B, V], cache)` is the jitted
    whole-model call over the engine's KV backend (unused by the tiered runner, which runs
    layer by layer); `forward` is the same function unjitted, for programs that loop over it
    (`runtime.multistep`), and `programs` caches those programs for the engine's life."""

    graphdef: Any
    params: Any
    model_cfg: ModelConfig
    config: EngineConfig
    step: Callable
    forward: Optional[Callable] = None
    pages: Any = None  # gemini_jax.cache.manager.KVCacheManager: block tables, refcounts, prefix hashes
    store: Any = None  # PooledStore | TieredStore
    mesh: Optional[Any] = None
    prefixes: Any = None  # gemini_jax.tiers.prefix_store.PrefixStore (tier.persistent), else None
    soft: Any = None  # gemini_jax.runtime.soft.SoftTable: soft tokens' rows (token ids >= vocab_size)
    seq_ids: Any = field(default_factory=itertools.count)
    programs: dict = field(default_factory=dict)

    def program(self, key, build: Callable):
        """The program cached under `key` (built by `build()` the first time)."""
        if key not in self.programs:
            self.programs[key] = build()
        return self.programs[key]

    @property
    def cache_dtype(self):
        return jnp.dtype(self.config.cache.dtype or self.model_cfg.dtype)

    def new_ids(self, n: int) -> list[int]:
        """Fresh sequence ids (unique over the engine's life)."""
        return [next(self.seq_ids) for _ in range(n)]


def model_call(graphdef, backend, params, cache, tokens, positions, select, rope=None):
    """One jitted model call: tokens/positions [B, T] -> logits f32[B, V] at `select`, new cache.
    `rope` [B, T]: the tokens' positions when `positions` are cache slots that differ from them
    (syntax-aligned pages); None: the same."""
    model = nnx.merge(graphdef, params)
    if rope is not None:
        logits, cache = model(tokens, rope, backend, cache, select=select, slots=positions)
    else:
        logits, cache = model(tokens, positions, backend, cache, select=select)
    return logits[:, 0], cache
