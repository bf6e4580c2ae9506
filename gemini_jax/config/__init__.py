"""Frozen, validated configuration dataclasses, one module per concern.

Everything static lives here; all of it is hashable so it can be a `jax.jit` static argument.
Changing state (weights, caches, counters) lives elsewhere. Each config validates itself once,
at construction, and names the field, the value and what is allowed when it refuses; which
features combine across concerns is one table, `gemini_jax.config.compat`.

    model.py     ModelConfig, RopeConfig (a decoder's shape)     sampling.py  SamplingParams
    cache.py     CacheConfig (the KV cache)                      sparse.py    SparseConfig
    tier.py      TierConfig, LinkConfig (tiers, links)           engine.py    EngineConfig
    hardware.py  MeshConfig, HardwareConfig (machines)           serve.py     ServeConfig
    compat.py    which features combine                          base.py      from_dict, replace
"""

from gemini_jax.config.base import from_dict, replace
from gemini_jax.config.cache import ALIGN_MODES, KV_QUANT_DTYPES, CacheConfig
from gemini_jax.config.engine import EngineConfig
from gemini_jax.config.hardware import HardwareConfig, MeshConfig
from gemini_jax.config.model import (ACTIVATIONS, DTYPES, FAMILIES, NORM_KINDS, ROPE_KINDS, ModelConfig, RopeConfig,
                                     windows_spec)
from gemini_jax.config.sampling import SamplingParams
from gemini_jax.config.serve import PREEMPT_MODES, ServeConfig
from gemini_jax.config.sparse import BUDGET_MODES, DIGEST_KINDS, GROUP_REDUCE, SparseConfig
from gemini_jax.config.tier import DISK_LAYOUTS, LINK_MODES, ON_CORRUPT, WRITE_POLICIES, LinkConfig, TierConfig

__all__ = [
    "ACTIVATIONS", "ALIGN_MODES", "BUDGET_MODES", "DIGEST_KINDS", "DISK_LAYOUTS", "DTYPES", "FAMILIES", "GROUP_REDUCE",
    "KV_QUANT_DTYPES", "LINK_MODES", "NORM_KINDS", "ON_CORRUPT", "PREEMPT_MODES", "ROPE_KINDS", "WRITE_POLICIES",
    "CacheConfig", "EngineConfig", "HardwareConfig", "LinkConfig", "MeshConfig", "ModelConfig", "RopeConfig",
    "SamplingParams", "ServeConfig", "SparseConfig", "TierConfig", "from_dict", "replace", "windows_spec",
]
