"""A small convolutional image encoder: three 3x3 convolutions, 8x8 -> 4x4 -> 2x2, one vector per
2x2 cell (4 vectors of `d_enc`).

    f32[N, 8, 8] (0..1) -> conv c, gelu -> conv 2c stride 2, gelu -> conv d_enc stride 2 -> LayerNorm
    -> f32[N, 4, d_enc]
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from gemini_jax.encoders.base import ImageEncoder
from gemini_jax.errors import ConfigError

CLASSES = 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConvConfig:
    """`channels` in the first convolution (twice that in the second), `d_enc` out of the third."""

    channels: int = 16
    d_enc: int = 48

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ConvConfig.{field.name}={value!r} must be a positive int.")

    @property
    def n_vectors(self) -> int:
        return 4  # the 2x2 cells left after two stride-2 convolutions of an 8x8 image


class ConvEncoder(ImageEncoder):
    kind = "cnn"

    def __init__(self, config: ConvConfig, *, rngs: nnx.Rngs):
        self.config = config
        c = config.channels
        self.conv1 = nnx.Conv(1, c, (3, 3), rngs=rngs)
        self.conv2 = nnx.Conv(c, 2 * c, (3, 3), strides=2, rngs=rngs)
        self.conv3 = nnx.Conv(2 * c, config.d_enc, (3, 3), strides=2, rngs=rngs)
        # Normalized outputs keep the projector's input scale fixed whatever the pretraining did.
        self.norm = nnx.LayerNorm(config.d_enc, rngs=rngs)
        self.head = nnx.Linear(config.d_enc, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # f32[N, 8, 8] -> f32[N, 4, d_enc]
        h = jax.nn.gelu(self.conv1(x[..., None]))
        h = jax.nn.gelu(self.conv2(h))                    # [N, 4, 4, 2c]
        h = self.conv3(h)                                 # [N, 2, 2, d_enc]
        return self.norm(h.reshape(h.shape[0], self.n_vectors, self.config.d_enc))
