"""A small MLP-mixer image encoder: the 8x8 image cut into four 4x4 patches, each a token; mixer blocks
alternate an MLP across the tokens and one across the channels (4 vectors of `d_enc`).

    f32[N, 8, 8] (0..1) -> patches [N, 4, 16] -> Linear d_enc + position -> blocks x (token MLP,
    channel MLP, both pre-norm residual) -> LayerNorm -> f32[N, 4, d_enc]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from gemini_jax.encoders.base import IMAGE_SHAPE, ImageEncoder
from gemini_jax.errors import ConfigError

CLASSES = 10
PATCH = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixerConfig:
    """`d_enc` channels per token, `blocks` mixer blocks, hidden widths of the token and channel MLPs."""

    d_enc: int = 64
    blocks: int = 2
    token_hidden: int = 16
    channel_hidden: int = 128

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"MixerConfig.{field.name}={value!r} must be a positive int.")

    @property
    def n_vectors(self) -> int:
        return (IMAGE_SHAPE[0] // PATCH) * (IMAGE_SHAPE[1] // PATCH)


class MixerBlock(nnx.Module):
    def __init__(self, tokens: int, config: MixerConfig, *, rngs: nnx.Rngs):
        self.token_norm = nnx.LayerNorm(config.d_enc, rngs=rngs)
        self.token_in = nnx.Linear(tokens, config.token_hidden, rngs=rngs)
        self.token_out = nnx.Linear(config.token_hidden, tokens, rngs=rngs)
        self.channel_norm = nnx.LayerNorm(config.d_enc, rngs=rngs)
        self.channel_in = nnx.Linear(config.d_enc, config.channel_hidden, rngs=rngs)
        self.channel_out = nnx.Linear(config.channel_hidden, config.d_enc, rngs=rngs)

    def __call__(self, h: jax.Array) -> jax.Array:  # f32[N, tokens, d_enc] -> same
        y = jnp.swapaxes(self.token_norm(h), 1, 2)         # [N, d_enc, tokens]: mix across patches
        h = h + jnp.swapaxes(self.token_out(jax.nn.gelu(self.token_in(y))), 1, 2)
        return h + self.channel_out(jax.nn.gelu(self.channel_in(self.channel_norm(h))))


class MixerEncoder(ImageEncoder):
    kind = "mixer"

    def __init__(self, config: MixerConfig, *, rngs: nnx.Rngs):
        self.config = config
        tokens = config.n_vectors
        self.patch_in = nnx.Linear(PATCH * PATCH, config.d_enc, rngs=rngs)
        self.position = nnx.Param(0.02 * jax.random.normal(rngs.params(), (tokens, config.d_enc)))
        self.blocks = nnx.List([MixerBlock(tokens, config, rngs=rngs) for _ in range(config.blocks)])
        self.norm = nnx.LayerNorm(config.d_enc, rngs=rngs)
        self.head = nnx.Linear(config.d_enc, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # f32[N, 8, 8] -> f32[N, 4, d_enc]
        n = x.shape[0]
        rows, cols = IMAGE_SHAPE[0] // PATCH, IMAGE_SHAPE[1] // PATCH
        # [N, 8, 8] -> [N, rows, PATCH, cols, PATCH] -> [N, rows*cols, PATCH*PATCH], patches row-major
        patches = x.reshape(n, rows, PATCH, cols, PATCH).transpose(0, 1, 3, 2, 4).reshape(n, rows * cols, -1)
        h = self.patch_in(patches) + self.position[...]
        for block in self.blocks:
            h = block(h)
        return self.norm(h)
