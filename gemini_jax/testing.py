"""Builders for tests and notebooks: tiny random models with each family's quirks, seeded inputs.

    from gemini_jax.testing import FAMILIES, random_model, random_prompts, tiny_config
    model = random_model(tiny_config("gemma2"), seed=3)   # every weight random, none inert
"""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from gemini_jax.config import ModelConfig, RopeConfig
from gemini_jax.model import Decoder


def tiny_config(family: str = "llama", **over) -> ModelConfig:
    """A very small config with the family's quirks switched on."""
    base = dict(family=family, vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position=4096, norm_eps=1e-6)
    quirks = {
        "llama": dict(rope=RopeConfig(theta=500000.0, kind="llama3", factor=8.0,
                                          original_max_position=64)),
        "mistral": dict(layer_windows=(7, 7, 7)),
        "qwen2": dict(qkv_bias=True),
        "qwen3": dict(qk_norm=True),
        "gemma2": dict(norm_kind="rms_plus_one", activation="gelu_tanh", sandwich_norms=True,
                       embed_scale=True, attn_scale=0.2, attn_softcap=50.0, final_softcap=30.0,
                       tie_embeddings=True, layer_windows=(6, 0, 6)),
        "gemma3": dict(norm_kind="rms_plus_one", activation="gelu_tanh", sandwich_norms=True,
                       embed_scale=True, qk_norm=True, attn_scale=0.25, tie_embeddings=True,
                       rope=RopeConfig(theta=1e6, kind="linear", factor=8.0),
                       local_rope=RopeConfig(theta=1e4), layer_windows=(5, 5, 0)),
        "tiny": dict(),
    }[family]
    return ModelConfig(**{**base, **quirks, **over})


def random_model(cfg: ModelConfig, seed: int) -> Decoder:
    """A model whose every weight (norms and biases included) is random, so no tensor is inert."""
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")


def random_prompts(rng: np.random.Generator, vocab: int, lengths) -> list[list[int]]:
    """Token ids drawn from `rng` (seed it: the seed belongs in the failure message)."""
    return [[int(x) for x in rng.integers(0, vocab, n)] for n in lengths]
